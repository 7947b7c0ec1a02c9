# Anchor for bench_kda_decode_gpu: FLA's fused_recurrent_kda on the same shapes (one token for
# each of N sequences, H = HV = 64, K = V = 128, bf16 inputs, fp32 state, in-kernel q/k L2 norm,
# final state written in place). Median of triton.testing.do_bench. FLA comes from the PyPI
# wheels fla-core / flash-linear-attention carried to the device (never committed).
import torch
import triton
from fla.ops.kda import fused_recurrent_kda

H, K, V = 64, 128, 128
print(f"{'N':>6} {'FLA ms':>10} {'Mtok/s':>12} {'GB/s':>9}")
for N in (1, 8, 32, 128, 512):
    torch.manual_seed(N)
    dev = "cuda"
    q = torch.randn(1, N, H, K, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, N, H, K, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, N, H, V, device=dev, dtype=torch.bfloat16)
    g = torch.empty(1, N, H, K, device=dev, dtype=torch.float32).uniform_(-5, -0.001)
    beta = torch.empty(1, N, H, device=dev, dtype=torch.float32).uniform_(0.01, 0.99)
    h0 = 0.1 * torch.randn(N, H, K, V, device=dev, dtype=torch.float32)
    cu = torch.arange(N + 1, device=dev, dtype=torch.long)

    def step():
        return fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                   inplace_final_state=True)

    step()
    ms = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
    nbytes = N * H * (2 * K * V * 4 + 2 * K * 2 + V * 2 + K * 4 + 4 + V * 2)
    print(f"{N:>6} {ms:>10.4f} {N / (ms * 1e-3) / 1e6:>12.3f} {nbytes / (ms * 1e-3) / 1e9:>9.1f}")
