"""The PyTorch side of the whole-model step benchmark (bench/bench_model_gpu.cpp): the same model
config trained on the same kind of data by transformers' Glm5NextTextModel, with FLA's chunked KDA
kernels when FLA is installed (transformers picks `fla.chunk_kda` itself when it imports), for the
side-by-side tokens/s ratio.

    python3 bench/model_step_torch.py [--config configs/bench_glm_2b.json] [--seq 4096]
        [--batch 2] [--steps 5] [--warmup 2]

The recipe is PyTorch's usual mixed precision: FP32 parameters, the forward and backward under
torch.autocast(bfloat16) (lm_head included; the cross-entropy on the logits in FP32), and the fused AdamW
(FP32 state) - the same arithmetic as hybridlm's bf16 weights with FP32 master weights, in
PyTorch's form. `batch` sequences of `seq` random tokens per step (hybridlm packs the same
documents into one sequence; the attention sees the same tokens either way). No MTP (the text model
has no MTP block): compare with `bench_model_gpu --no-mtp`.

Prints the median step time (CUDA events around forward, backward and the optimizer step),
tokens/s, and torch.cuda.max_memory_allocated.
"""
import argparse
import json
import statistics
import sys
import time

import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/bench_glm_2b.json")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args()
    try:
        from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel
    except ImportError as e:
        sys.exit(f"model_step_torch.py: transformers with glm5_next is needed: {e}")
    try:
        import fla  # noqa: F401

        kda = "FLA chunk_kda"
    except ImportError:
        kda = "transformers' torch fallback (FLA not installed)"
    cfg = json.load(open(a.config))
    cfg.pop("model_type", None)
    cfg.pop("dtype", None)
    cfg["pad_token_id"] = None
    config = Glm5NextTextConfig(**cfg)
    torch.manual_seed(1)
    dev = torch.device("cuda")
    model = Glm5NextTextModel(config).to(dev)
    head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False).to(dev)
    params = list(model.parameters()) + list(head.parameters())
    n = sum(t.numel() for t in params)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; KDA: {kda}; "
          f"attention {config._attn_implementation}; {n / 1e9:.3f} B parameters (with lm_head)",
          flush=True)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    T = a.seq * a.batch
    ids = torch.randint(0, config.vocab_size, (a.batch, a.seq + 1), device=dev)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def step(verbose=False):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = head(model(input_ids=x).last_hidden_state)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        if verbose:
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            print(f"  forward {t1 - t0:.1f} s", flush=True)
        loss.backward()
        if verbose:
            torch.cuda.synchronize()
            print(f"  backward {time.perf_counter() - t1:.1f} s", flush=True)
        opt.step()
        return loss

    for i in range(a.warmup):
        t0 = time.perf_counter()
        step(verbose=True)
        torch.cuda.synchronize()
        print(f"warm-up step {i + 1}: {time.perf_counter() - t0:.1f} s", flush=True)
    torch.cuda.reset_peak_memory_stats()
    ms = []
    for _ in range(a.steps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        loss = step()
        e1.record()
        e1.synchronize()
        ms.append(e0.elapsed_time(e1))
        print(f"step {len(ms)}: {ms[-1]:.1f} ms", flush=True)
    med = statistics.median(ms)
    print("step times (ms): " + " ".join(f"{t:.1f}" for t in ms))
    print(f"median step {med:.1f} ms: {T / (med * 1e-3):.0f} tokens/s; loss {loss.item():.4f}; "
          f"peak memory allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
