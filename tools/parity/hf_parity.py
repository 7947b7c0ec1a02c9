"""Reference side of the parity check against transformers' Glm5NextTextModel (eager).

  python3 hf_parity.py DIR [--seed S] [--batch B] [--seq T] [--dtype float64|float32]

DIR/config.json is a glm5_next / glm5_next_text config (as `hybridlm` writes it). The script builds
the model with that config, draws every parameter at random (so no zero or one initialisation can
hide a mismatch), saves it with save_pretrained into DIR (model.safetensors), draws input_ids [B, T]
and a probe shaped like last_hidden_state, and writes
  DIR/tokens.safetensors  input_ids I64 [B, T]
  DIR/probe.safetensors   probe F32 [B, T, D]
  DIR/ref.safetensors     last_hidden_state F32 [B, T, D] and grad.NAME F32 for every parameter,
                          the gradients of sum(last_hidden_state * probe)
  DIR/indices.safetensors layers.<i> I32 [B, T, W]: the token set each DSA layer attended
The forward runs in --dtype (float64 by default, a sharper reference than float32).
Then `hybridlm forward --model DIR --tokens DIR/tokens.safetensors --grad-probe DIR/probe.safetensors
--out DIR/ours.safetensors` and `compare.py DIR/ref.safetensors DIR/ours.safetensors` finish the check.
"""
import argparse, json, os

import torch
from hf_config import transformers_kwargs
from hf_random import randomize
from safetensors.torch import save_file
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

ap = argparse.ArgumentParser()
ap.add_argument("dir")
ap.add_argument("--seed", type=int, default=1234)
ap.add_argument("--batch", type=int, default=2)
ap.add_argument("--seq", type=int, default=80)
ap.add_argument("--dtype", default="float64", choices=["float64", "float32"])
args = ap.parse_args()
dtype = getattr(torch, args.dtype)

with open(os.path.join(args.dir, "config.json")) as f:
    cfg = json.load(f)
cfg = transformers_kwargs(cfg)
with open(os.path.join(args.dir, "config.ours.json"), "w") as f:
    json.dump(cfg | {"model_type": "glm5_next_text"}, f, indent=1)
config = Glm5NextTextConfig(**cfg)
config._attn_implementation = "eager"
config._experts_implementation = "eager"  # the reference loop (grouped_mm has no float64)

torch.manual_seed(args.seed)
model = Glm5NextTextModel(config).to(dtype)
randomize(model, 0.02)
# save_pretrained rewrites DIR/config.json with every field the model used (HF's full form).
model.save_pretrained(args.dir, safe_serialization=True)

ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
# Capture every indexer's selection (the DSA layers' attended token sets) for replay.
selections = {}
for i, layer in enumerate(model.layers):
    ix = getattr(layer.self_attn, "indexer", None)
    if ix is not None:
        ix.register_forward_hook(
            lambda mod, inp, out, i=i: selections.__setitem__(f"layers.{i}", out.to(torch.int32).contiguous()))
# ... and the pool scores each indexer ranked (the argument of its topk), to look for ties.
scores = {}
_topk = torch.Tensor.topk
current = {"layer": None}


def recording_topk(t, k, *a, **kw):
    if current["layer"] is not None:
        scores[current["layer"]] = t.detach().double().contiguous()
    return _topk(t, k, *a, **kw)


for i, layer in enumerate(model.layers):
    ix = getattr(layer.self_attn, "indexer", None)
    if ix is not None:
        ix.register_forward_pre_hook(lambda mod, inp, i=i: current.__setitem__("layer", f"layers.{i}"))
        ix.register_forward_hook(lambda mod, inp, out: current.__setitem__("layer", None))
torch.Tensor.topk = recording_topk
out = model(input_ids=ids).last_hidden_state
torch.Tensor.topk = _topk
probe = torch.randn_like(out)
loss = (out * probe).sum()
loss.backward()
save_file({"input_ids": ids.to(torch.int64).contiguous()}, os.path.join(args.dir, "tokens.safetensors"))
save_file({"probe": probe.float().contiguous()}, os.path.join(args.dir, "probe.safetensors"))
save_file(selections, os.path.join(args.dir, "indices.safetensors"))
save_file(scores, os.path.join(args.dir, "pool_scores.safetensors"))
ref = {"last_hidden_state": out.detach().float().contiguous()}
for name, p in model.named_parameters():
    if p.grad is not None:
        ref["grad." + name] = p.grad.float().contiguous()
save_file(ref, os.path.join(args.dir, "ref.safetensors"))
print(f"reference: {sum(p.numel() for p in model.parameters())} parameters, B={args.batch} "
      f"T={args.seq}, dtype {args.dtype}, |h| = {out.norm().item():.6g}")
