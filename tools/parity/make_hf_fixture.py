"""Writes tests/data/hf_glm5_next/: a tiny GLM-5.3-Flash text model saved by transformers'
save_pretrained (the published checkpoint layout, transformers 5.25 or later), with reference
outputs, for the tests that load a real checkpoint (tests/model/hf_checkpoint_test.cpp).

  python3 tools/parity/make_hf_fixture.py [OUT_DIR]     (needs torch and transformers >= 5.25)

The model: 3 layers (KDA + dense MLP, DSA with KPool + MoE, KDA + MoE), mHC with 2 streams,
every parameter drawn at random (so no zero or one initialisation hides a mismatch), saved in
float32 with a config.json that names no gemm_precision (the precision must follow the
checkpoint's dtype). The reference runs the same weights in float64 (a sharper reference than
float32) on input_ids [2, 24] and writes
  tokens.safetensors   input_ids I64 [2, 24]
  probe.safetensors    probe F32 [2, 24, 32]
  ref.safetensors      last_hidden_state F32 and grad.<name> F32 for every parameter (PyTorch's
                       named_parameters() names), the gradients of sum(last_hidden_state * probe)
  indices.safetensors  layers.<i> I32 [2, 24, W]: the token sets the DSA layer attended
"""
import os
import sys

import torch
from hf_random import randomize
from safetensors.torch import save_file
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(__file__), "..", "..", "tests", "data", "hf_glm5_next")
os.makedirs(out_dir, exist_ok=True)

config = Glm5NextTextConfig(
    vocab_size=48, hidden_size=32, num_hidden_layers=3, intermediate_size=48,
    hidden_act="silu", swiglu_limit=10.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    max_position_embeddings=256,
    layer_types=["linear_attention", "indexed_attention", "linear_attention"],
    mlp_layer_types=["dense", "sparse", "sparse"], indexer_types=["full", "full", "full"],
    linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16,
    qk_nope_head_dim=8, qk_rope_head_dim=0, v_head_dim=8, mla_use_nope=True,
    index_n_heads=2, index_head_dim=8, index_topk=8, index_kpool=2, index_kpool_compress=True,
    index_kpool_always_select_tail=True,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
    n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    scoring_func="sigmoid", topk_method="noaux_tc", router_aux_loss_coef=0.001,
    mhc=True, hc_mult=2, hc_sinkhorn_iters=20, hc_eps=1e-6,
    num_nextn_predict_layers=0, pad_token_id=None, bos_token_id=None, eos_token_id=None)
config._attn_implementation = "eager"
config._experts_implementation = "eager"  # the reference loop (grouped_mm has no float64)

torch.manual_seed(20261205)
model = Glm5NextTextModel(config).to(torch.float32)
randomize(model, 0.05)
model.save_pretrained(out_dir, safe_serialization=True)

model = model.to(torch.float64)
ids = torch.randint(0, config.vocab_size, (2, 24))
selections = {}
for i, layer in enumerate(model.layers):
    ix = getattr(layer.self_attn, "indexer", None)
    if ix is not None:
        ix.register_forward_hook(lambda mod, inp, out, i=i: selections.__setitem__(
            f"layers.{i}", out.to(torch.int32).contiguous()))
out = model(input_ids=ids).last_hidden_state
gen = torch.Generator().manual_seed(7)
probe = torch.randn(out.shape, generator=gen, dtype=torch.float64)
(out * probe).sum().backward()
save_file({"input_ids": ids.to(torch.int64).contiguous()}, os.path.join(out_dir, "tokens.safetensors"))
save_file({"probe": probe.float().contiguous()}, os.path.join(out_dir, "probe.safetensors"))
save_file(selections, os.path.join(out_dir, "indices.safetensors"))
ref = {"last_hidden_state": out.detach().float().contiguous()}
for name, p in model.named_parameters():
    if p.grad is not None:
        ref["grad." + name] = p.grad.float().contiguous()
save_file(ref, os.path.join(out_dir, "ref.safetensors"))
n = sum(p.numel() for p in model.parameters())
print(f"{out_dir}: {n} parameters, {len(ref) - 1} gradients, |h| = {out.norm().item():.6g}")
