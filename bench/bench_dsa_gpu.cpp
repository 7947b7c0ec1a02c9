// DSA layer ops on the GPU at GLM-5.3-Flash's shapes: indexer (H_I = 32, d_I = 128, bf16),
// KPool (P = 4) and top-k (2048 tokens: 512 pools + the 3-token tail), then the sparse MLA
// attention in the absorbed NoPE form (H = 64, D_qk = d_v = 512, bf16) forward and backward over
// that selection, for T = 8192 and 32768 tokens packed as two documents (3/4 and 1/4 of T).
//
// Prints, per T: the time of each op (median of the timed calls, CUDA events around the front
// door, so host-side checks and the index pattern the front door builds are included), that
// pattern alone (checking the selection and building its pattern and inverse map on the device,
// cuda::device_rows_pattern), and the sparse attention's TFLOP/s counting only the selected keys:
//   forward  2 H n (D_qk + d_v)        (logits and the weighted sum of values)
//   backward 2 H n (3 D_qk + 2 d_v)    (logits again, dP, dV, dQ, dK: FlashAttention's count)
// with n the number of selected (query, key) pairs, and the fraction of 790 TFLOP/s, the BF16
// tensor-core rate the project's targets count against (NVIDIA lists 989 TFLOP/s dense BF16 for
// the H100 SXM at its boost clock), and the peak device memory of each T (core/device.h). The
// baseline is cuBLAS: the same two products as the sparse forward, for every query against 2048
// shared keys (cublasGemmStridedBatchedEx, bf16 in, f32 accumulate), the rate dense attention
// reaches at these shapes. Last, per T, the whole DSA layer forward and backward (time_layer), and
// where its time goes (core/profile.h).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "core/device.h"
#include "core/profile.h"
#include "core/rng.h"
#include "core/seq_layout.h"
#include "gpu_timing.h"
#include "layers/dsa/dsa_layer.h"
#include "ops/cuda/dsa_common.cuh"
#include "ops/dsa_common.h"
#include "ops/dsa_indexer.h"
#include "ops/dsa_kpool.h"
#include "ops/dsa_sparse_attention.h"

#ifdef HLM_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

namespace {

constexpr double kPeakTflops = 790.0;

#ifdef HLM_HAVE_CUDA
// Median milliseconds of `reps` calls of f after one warm-up call.
double time_ms(const std::function<void()>& f, int reps) {
  return hlm::bench::median_ms(f, reps, 1);
}

// A bf16 CUDA tensor [T, row...] of normal draws: 1024 random rows repeated (drawing 2^30 normals
// on one host core would take longer than every op timed here; the timings do not depend on the
// values beyond their scale).
hlm::Tensor tiled_randn(int64_t T, const hlm::Shape& row, hlm::Rng& rng) {
  using namespace hlm;
  const int64_t R = std::min<int64_t>(T, 1024);
  Shape shape{R};
  shape.insert(shape.end(), row.begin(), row.end());
  const Tensor block = randn(shape, DType::bf16, rng);
  shape[0] = T;
  Tensor out = Tensor::empty(shape, DType::bf16);
  const size_t bytes = size_t(block.numel()) * 2;
  for (int64_t r0 = 0; r0 < T; r0 += R)
    std::memcpy(static_cast<char*>(out.raw()) + size_t(r0 / R) * bytes, block.raw(),
                size_t(std::min(R, T - r0)) * bytes / size_t(R));
  return out.to(Device::cuda);
}

// cuBLAS: for each of `batch` queries, S = Q_t K^T ([H, n] from [H, D] x [n, D]^T) and
// O = S V ([H, d_v]); K and V shared by every query (stride 0). bf16 in and out, f32 accumulate.
double dense_baseline_ms(int64_t batch, int64_t H, int64_t D, int64_t dv, int64_t n, int reps) {
  cublasHandle_t h;
  cublasCreate(&h);
  void *q, *k, *v, *s, *o;
  cudaMalloc(&q, size_t(batch * H * D * 2));
  cudaMalloc(&k, size_t(n * D * 2));
  cudaMalloc(&v, size_t(n * dv * 2));
  cudaMalloc(&s, size_t(batch * H * n * 2));
  cudaMalloc(&o, size_t(batch * H * dv * 2));
  // Bytes 0x3c: every bf16 element 0x3c3c (about 0.0115). Nonzero operands, since all-zero
  // operands draw less power and can run the tensor cores at a higher clock.
  cudaMemset(q, 0x3c, size_t(batch * H * D * 2));
  cudaMemset(k, 0x3c, size_t(n * D * 2));
  cudaMemset(v, 0x3c, size_t(n * dv * 2));
  cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
  const float one = 1.f, zero = 0.f;
  auto run = [&] {
    // Column-major: S^T [n, H] = K [n, D] (as D x n transposed) x Q^T [D, H].
    st = cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(H), int(D), &one, k,
                                    CUDA_R_16BF, int(D), 0, q, CUDA_R_16BF, int(D), H * D, &zero, s,
                                    CUDA_R_16BF, int(n), H * n, int(batch), CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT);
    // O^T [dv, H] = V^T [dv, n] x S^T [n, H].
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, int(dv), int(H), int(n), &one, v,
                                      CUDA_R_16BF, int(dv), 0, s, CUDA_R_16BF, int(n), H * n, &zero,
                                      o, CUDA_R_16BF, int(dv), H * dv, int(batch),
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  const double ms = time_ms(run, reps);
  if (st != CUBLAS_STATUS_SUCCESS) std::printf("  cuBLAS baseline failed: status %d\n", int(st));
  for (void* p : {q, k, v, s, o}) cudaFree(p);
  cublasDestroy(h);
  return ms;
}

// The whole DSA layer (layers/dsa/dsa_layer.h) at GLM-5.3-Flash's shapes: D = 4096, H = 64,
// q_lora 1536, kv_lora 512, NoPE d_nope = d_v = 256; the indexer as above; bf16 parameters and
// the default precision policy (bf16 GEMMs, bf16 attention operands); sparse stage with the
// indexer loss. Forward (training, so the indexer loss and the saved activations are included) and
// backward (the indexer loss's backward included), median ms.
void time_layer(int64_t T, int reps) {
  using namespace hlm;
  DsaLayerConfig c;
  c.mla.hidden_size = 4096;
  c.mla.num_heads = 64;
  c.mla.q_lora_rank = 1536;
  c.mla.kv_lora_rank = 512;
  c.mla.qk_nope_head_dim = 256;
  c.mla.qk_rope_head_dim = 0;
  c.mla.v_head_dim = 256;
  c.mla.param_dtype = DType::bf16;
  IndexerConfig ic;
  ic.hidden_size = 4096;
  ic.q_lora_rank = 1536;
  ic.n_heads = 32;
  ic.head_dim = 128;
  ic.topk = 2048;
  ic.kpool = 4;
  ic.dtype = DType::bf16;
  ic.seed = 7;
  c.indexer = ic;
  DsaLayer layer(c, PrecisionPolicy{}, "model.layers.3.self_attn");
  layer.init_weights(11);
  layer.to(Device::cuda);
  const SeqLayout seqs = SeqLayout::from_lengths({T / 4 * 3, T / 4});
  Rng rng(99);
  const Tensor x = tiled_randn(T, {4096}, rng), dy = tiled_randn(T, {4096}, rng);
  cuda_reset_peak_memory();
  DsaLayer::Saved saved;
  DsaLayer::Output out;
  const double t_f = time_ms([&] { out = layer.forward(Context{}, x, seqs, &saved); }, reps);
  const double t_b = time_ms([&] { layer.backward(Context{}, dy, saved); }, reps);
  const CudaMemoryStats m = cuda_memory_stats();
  std::printf(
      "  DSA layer (D 4096, bf16, sparse + indexer loss): forward %.2f ms, backward %.2f ms, "
      "indexer loss %.4g; peak device memory in use %.2f GiB\n",
      t_f, t_b, out.indexer_loss, double(m.peak_in_use_bytes) / 1073741824.0);
  // Where the layer's time goes: one forward and backward with the profiler on (core/profile.h;
  // the device synchronised around each scope, so the sum exceeds the times above a little).
  profile::set_enabled(true);
  profile::reset();
  {
    HLM_PROFILE("forward");
    out = layer.forward(Context{}, x, seqs, &saved);
  }
  {
    HLM_PROFILE("backward");
    layer.backward(Context{}, dy, saved);
  }
  profile::set_enabled(false);
  std::printf("%s", profile::report().c_str());
}
#endif

}  // namespace

int main(int argc, char** argv) {
#ifndef HLM_HAVE_CUDA
  (void)argc, (void)argv;
  std::puts("bench_dsa_gpu: built without CUDA");
  return 0;
#else
  using namespace hlm;
  if (!cuda_available()) {
    std::puts("bench_dsa_gpu: no CUDA device present");
    return 0;
  }
  const int64_t HI = 32, DI = 128, P = 4, K = 2048, H = 64, D = 512, dv = 512;
  const double scale = 1.0 / std::sqrt(double(D));
  // Token counts from the command line (default 8192 32768), each a multiple of 4.
  std::vector<int64_t> Ts;
  for (int i = 1; i < argc; ++i) Ts.push_back(std::max<int64_t>(4, std::atoll(argv[i]) / 4 * 4));
  if (Ts.empty()) Ts = {8192, 32768};
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each line as soon as it is known
  for (int64_t T : Ts) {
    const std::vector<int64_t> lens{T / 4 * 3, T / 4};
    const SeqLayout seqs = SeqLayout::from_lengths(lens);
    Rng rng(4242 + uint64_t(T));
    const Tensor qi = randn({T, HI, DI}, DType::bf16, rng).to(Device::cuda);
    const Tensor ki = randn({T, DI}, DType::bf16, rng).to(Device::cuda);
    const Tensor gate = randn({T, DI}, DType::bf16, rng).to(Device::cuda);
    const Tensor ape = randn({P, DI}, DType::f32, rng, 0.1).to(Device::cuda);
    const Tensor w = randn({T, HI}, DType::bf16, rng, 1.0 / std::sqrt(double(HI))).to(Device::cuda);
    ops::IndexerScoreOptions so;
    so.pool = P;
    Tensor pooled, scores;
    ops::KPoolSelection sel;
    const int reps = T > 8192 ? 1 : 3;
    std::printf("T = %ld (documents %ld + %ld)\n", long(T), long(lens[0]), long(lens[1]));
    cuda_reset_peak_memory();
    const CudaMemoryStats m0 = cuda_memory_stats();
    const double t_pool = time_ms([&] { pooled = ops::kpool_compress(ki, gate, ape, seqs); }, reps);
    std::printf("  kpool_compress        %10.3f ms\n", t_pool);
    const double t_score =
        time_ms([&] { scores = ops::indexer_scores(qi, pooled, w, seqs, so); }, reps);
    std::printf("  indexer_scores (pool) %10.3f ms\n", t_score);
    const double t_sel = time_ms([&] { sel = ops::kpool_select(scores, seqs, K, P); }, reps);
    std::printf("  kpool_select (top-k) %11.3f ms\n", t_sel);

    const Tensor q = tiled_randn(T, {H, D}, rng);
    const Tensor kv = randn({T, D}, DType::bf16, rng).to(Device::cuda);
    const Tensor dout = tiled_randn(T, {H, dv}, rng);
    const Tensor idx_host = sel.indices.to(Device::cpu);
    int64_t n = 0;
    for (int64_t i = 0; i < idx_host.numel(); ++i) n += idx_host.data<int32_t>()[i] >= 0;
    std::printf("  selected pairs n = %ld (%.1f per query)\n", long(n), double(n) / double(T));
    const double t_pat = time_ms(
        [&] { ops::cuda::device_rows_pattern(sel.indices, seqs.offsets(), 1, "bench", "", false); },
        reps);
    const double t_pat_inv = time_ms(
        [&] { ops::cuda::device_rows_pattern(sel.indices, seqs.offsets(), 1, "bench", "", true); },
        reps);
    std::printf(
        "  selection pattern     %10.3f ms  (with the inverse map %.3f ms; on the device, inside "
        "each attention call below)\n",
        t_pat, t_pat_inv);
    ops::SparseAttentionOut fwd;
    const double t_fwd =
        time_ms([&] { fwd = ops::sparse_attention(q, kv, sel.indices, seqs, dv, scale); }, reps);
    const double f_fwd = 2.0 * double(H) * double(n) * double(D + dv);
    const double tf_fwd = f_fwd / (t_fwd * 1e-3) / 1e12;
    std::printf("  sparse forward        %10.3f ms  %8.2f TFLOP/s  %5.1f%% of %g\n", t_fwd, tf_fwd,
                100.0 * tf_fwd / kPeakTflops, kPeakTflops);
    std::printf("  indexer + selection   %10.3f ms  (%.3fx the sparse forward's time)\n",
                t_pool + t_score + t_sel, (t_pool + t_score + t_sel) / t_fwd);
    const double t_bwd = time_ms(
        [&] {
          ops::sparse_attention_backward(q, kv, sel.indices, seqs, dv, scale, fwd.out, fwd.lse,
                                         dout);
        },
        reps);
    const double f_bwd = 2.0 * double(H) * double(n) * double(3 * D + 2 * dv);
    const double tf_bwd = f_bwd / (t_bwd * 1e-3) / 1e12;
    std::printf("  sparse backward       %10.3f ms  %8.2f TFLOP/s  %5.1f%% of %g\n", t_bwd, tf_bwd,
                100.0 * tf_bwd / kPeakTflops, kPeakTflops);
    // Dense baseline: the forward's two products for 2048 queries at a time, scaled to T.
    const int64_t chunk = 2048;
    const double t_dense = dense_baseline_ms(chunk, H, D, dv, K, reps) * double(T) / double(chunk);
    const double tf_dense =
        2.0 * double(H) * double(T) * double(K) * double(D + dv) / (t_dense * 1e-3) / 1e12;
    std::printf(
        "  cuBLAS dense products %10.3f ms  %8.2f TFLOP/s  %5.1f%% of %g (2048 keys each)\n",
        t_dense, tf_dense, 100.0 * tf_dense / kPeakTflops, kPeakTflops);
    const CudaMemoryStats m1 = cuda_memory_stats();
    std::printf(
        "  device memory: peak in use %.2f GiB, peak reserved %.2f GiB; %llu cudaMalloc calls, "
        "%llu allocations from the cache\n",
        double(m1.peak_in_use_bytes) / 1073741824.0, double(m1.peak_reserved_bytes) / 1073741824.0,
        (unsigned long long)(m1.cuda_malloc_count - m0.cuda_malloc_count),
        (unsigned long long)(m1.cache_hits - m0.cache_hits));
    time_layer(T, reps);
  }
  return 0;
#endif
}
