"""Decoding side by side: `hybridlm generate` and transformers' Glm5NextTextModel with its own cache,
on the same checkpoint and prompts, in one run (the PyTorch baseline of docs/inference.md).

    python3 bench/decode_torch.py --hybridlm BUILD/hybridlm [--config configs/tiny.json]
        [--prompt 256] [--new 32] [--batches 1,8,64] [--dir WORK] [--threads N] [--device cpu|cuda]

The script builds the model from a hybridlm config with tied embeddings (so that the text model's
checkpoint carries the output head), draws every parameter at random (tools/parity/hf_random.py),
saves it with save_pretrained, and for each batch size B draws B prompts of --prompt tokens. Then:

  transformers  a greedy loop under torch.no_grad(): the prompts in one forward with use_cache
                (the time to the first token), then one token per sequence per forward over the
                cache (DynamicCache: the KDA conv / recurrent states and the DSA keys); logits =
                last_hidden_state @ embed_tokens^T. FP32, eager attention, torch's CPU threads;
                with --device cuda on the GPU (its KDA through FLA's kernels when FLA imports,
                else transformers' torch code), timed after torch.cuda.synchronize().
  hybridlm      `hybridlm generate --tokens P --max-new N --max-batch B --device D` (greedy,
                FP32): its own report of the time to the first token (the prefill) and of the
                whole generation.

Reported per batch: the time to the first token, the decode tokens/s of the steps after it
((B (N - 1)) / (total - first)), the ratio hybridlm / transformers of decode tokens/s, how many
generated tokens the two agree on (greedy; a near-tie can flip one token and everything after it),
and, as a check of the baseline itself, how many of transformers' cached greedy tokens are the arg
max of its own full forward over the prompt and the generated tokens. The cache goes to the model
under the keyword its forward takes (`cache` in transformers 5.25; `past_key_values` before).
"""
import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import time

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "parity"))
from hf_config import transformers_kwargs  # noqa: E402
from hf_random import randomize  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hybridlm", required=True)
    ap.add_argument("--config", default="configs/tiny.json")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--dir", default="/tmp/hlm_decode_torch")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a = ap.parse_args()
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    torch.set_num_threads(a.threads)
    os.makedirs(a.dir, exist_ok=True)
    cfg = transformers_kwargs(json.load(open(a.config)))
    cfg["tie_word_embeddings"] = True
    cfg["num_nextn_predict_layers"] = 0
    config = Glm5NextTextConfig(**cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(1)
    model = Glm5NextTextModel(config).float().eval()
    randomize(model, 0.02)
    model.save_pretrained(a.dir, safe_serialization=True)
    model = model.to(a.device)

    def sync():
        if a.device == "cuda":
            torch.cuda.synchronize()

    E = model.embed_tokens.weight
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    print(f"torch {torch.__version__} on {a.device} ({torch.get_num_threads()} threads); "
          f"model {a.config}: "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters; prompts of {a.prompt} "
          f"tokens, {a.new} new tokens each", flush=True)
    print(f"{'batch':>5} | {'first token ms':>14} {'decode tok/s':>12} | {'first token ms':>14} "
          f"{'decode tok/s':>12} | {'ratio':>6} | agree | torch cached = its full forward", flush=True)
    for B in [int(b) for b in a.batches.split(",")]:
        ids = torch.randint(0, config.vocab_size, (B, a.prompt))
        tok_file = os.path.join(a.dir, f"prompts_{B}.safetensors")
        save_file({"input_ids": ids.contiguous()}, tok_file)
        ids = ids.to(a.device)
        # transformers
        with torch.no_grad():
            sync()
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=True)
            nxt = (out.last_hidden_state[:, -1] @ E.T).argmax(-1)
            sync()
            first = time.perf_counter() - t0
            cache = out.past_key_values
            gen = [nxt]
            t1 = time.perf_counter()
            for _ in range(a.new - 1):
                out = model(input_ids=nxt[:, None], use_cache=True, **{cache_kw: cache})
                cache = out.past_key_values
                nxt = (out.last_hidden_state[:, -1] @ E.T).argmax(-1)
                gen.append(nxt)
            sync()
            decode = time.perf_counter() - t1
        ref = torch.stack(gen, 1)
        with torch.no_grad():  # the baseline's own check: its full forward's arg max
            full = model(input_ids=torch.cat([ids, ref], 1)).last_hidden_state[:, a.prompt - 1:-1]
            own = int(((full @ E.T).argmax(-1) == ref).sum())
        ref = ref.cpu()
        del out, cache, full
        if a.device == "cuda":
            torch.cuda.empty_cache()  # hybridlm runs next, in another process on the same GPU
        torch_tps = B * (a.new - 1) / decode
        # hybridlm
        out_file = os.path.join(a.dir, f"gen_{B}.safetensors")
        if os.path.exists(out_file):
            os.remove(out_file)
        r = subprocess.run([a.hybridlm, "generate", "--model", a.dir, "--tokens", tok_file,
                            "--max-new", str(a.new), "--max-batch", str(B), "--out", out_file,
                            "--device", a.device],
                           capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"decode_torch.py: hybridlm generate failed: {r.stderr.strip()}")
        m = re.search(r"(\d+) tokens in ([0-9.]+) s .*first token after ([0-9.]+) s", r.stderr)
        total, secs, ours_first = int(m.group(1)), float(m.group(2)), float(m.group(3))
        ours_tps = (total - B) / max(secs - ours_first, 1e-9)
        g = load_file(out_file)
        ours = g["tokens"].view(B, a.new)
        agree = int((ours == ref).sum())
        print(f"{B:>5} | {first * 1e3:>14.1f} {torch_tps:>12.1f} | {ours_first * 1e3:>14.1f} "
              f"{ours_tps:>12.1f} | {ours_tps / torch_tps:>5.2f}x | {agree}/{B * a.new} | "
              f"{own}/{B * a.new}", flush=True)
    print("columns: transformers | hybridlm | ratio of decode tokens/s (hybridlm / transformers)")


if __name__ == "__main__":
    main()
