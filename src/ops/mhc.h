// mHC (manifold-constrained hyper-connections) as shipped in GLM-5.3-Flash (docs/mhc_moe.md,
// "mHC", the contract). The residual is n streams X [T, n, D] per token. One "site" (attn or ffn of
// a decoder layer) does, per token, with flat = vec(X) in R^{nD} (stream-major: flat[j*D + d]):
//
//   inv_rms  = 1 / sqrt(mean(flat^2) + norm_eps)                    eps INSIDE the sqrt (1e-5)
//   mix      = (fn @ flat) * inv_rms                 [(2+n) n]      fn [(2+n) n, nD]
//   pre_j    = sigmoid(mix[j] * scale[0] + base[j]) + hc_eps                 j < n
//   post_j   = 2 sigmoid(mix[n+j] * scale[1] + base[n+j])                    j < n
//   L[i][j]  = mix[2n + n i + j] * scale[2] + base[2n + n i + j]             (row-major n x n)
//   comb     = sinkhorn(L): M = softmax_row(L) + hc_eps; M = M / (colsum(M) + hc_eps);
//              (iters - 1) times: M = M / (rowsum(M) + hc_eps); M = M / (colsum(M) + hc_eps)
//              (no exact final projection: columns sum to ~1, rows only approximately)
//   u        = sum_j pre_j X_j                        the sublayer input [T, D]
//   y        = F(RMSNorm_w(u))                        the sublayer (not here)
//   X'_i     = post_i y + sum_j comb[j][i] X_j        write-back with comb TRANSPOSED
//
// Model level: X^0_j = embed for all j (mhc_expand); exit h = (1/n) sum_j X^L_j (the mean output
// contract, no learned head: mhc_mean_contract).
//
// Precision: computed in FP64 when X is f64, else in FP32 (the mappings are FP32 as in the
// reference; bf16 X is read into FP32 and u / X' are stored back in X's dtype). Parameters fn,
// base, scale may be f32 or f64; they are read in the computation dtype. Every reduction runs in a
// fixed order (per token, then over tokens in token order for parameter gradients): no atomics,
// bit-identical run to run.
//
// Gradients: activation gradients are returned (=); parameter gradients accumulate (+=) into the
// caller's tensors (f32 or f64, of the parameter's shape). The Sinkhorn backward recomputes the
// iterations per token and differentiates through every one of them.
//
// Devices and dtypes. Every op runs on the device of its inputs (all on one device); outputs are
// allocated there. CPU (ops/cpu/mhc.cpp, the reference): tensors of any floating dtype. CUDA
// (ops/cuda/mhc.cu; docs/mhc_moe.md, "mHC on CUDA"): every tensor f32, f64 or bf16, each
// independently (bf16 streams with f32 parameters, an f32 y or f32 gradients are read as they
// are, no conversion pass); any strides (a strided input is first copied contiguous); at most 8
// streams (n <= 8; mhc_expand, mhc_mean_contract and their backwards take any n); the parameter
// gradient accumulators contiguous. The computation dtype (f64 for f64 x, else f32) and the
// output dtypes are the same on both devices. CUDA results agree with the CPU's within rounding,
// not bit for bit (the projection fn @ flat and its two backward products run in cuBLAS, in
// another summation order; exp and multiply-adds round differently); two CUDA runs give the same
// bits.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace hlm::ops {

struct MhcConfig {
  int64_t n = 4;           // hc_mult: number of streams
  double hc_eps = 1e-6;    // added to pre, inside the softmax output and every Sinkhorn sum
  double norm_eps = 1e-5;  // rms_norm_eps: inside the sqrt of the flat RMS
  int64_t sinkhorn_iters =
      20;  // hc_sinkhorn_iters (>= 1): softmax+col, then (iters-1) x (row, col)
  int64_t n_mix() const { return (2 + n) * n; }
};

struct MhcParams {
  Tensor fn;     // [(2+n) n, n D]: rows 0..n-1 pre, n..2n-1 post, 2n.. comb (row-major n x n)
  Tensor base;   // [(2+n) n]
  Tensor scale;  // [3] = (scale_pre, scale_post, scale_comb)
};

// Parameter gradient accumulators (+=), shapes of MhcParams.
struct MhcParamGrads {
  Tensor dfn, dbase, dscale;
};

// ---- pieces ----------------------------------------------------------------------------------

// The mappings of one site: everything from X to (pre, post, comb).
struct MhcMappings {
  Tensor inv_rms;      // [T]
  Tensor mix;          // [T, (2+n) n]: (fn @ flat) * inv_rms
  Tensor pre;          // [T, n]
  Tensor post;         // [T, n]
  Tensor comb_logits;  // [T, n, n]: L (Sinkhorn input)
  Tensor comb;         // [T, n, n]: sinkhorn(L)
};
MhcMappings mhc_mappings_forward(const Tensor& x, const MhcParams& p, const MhcConfig& c);
// Backward of the mappings: given dpre, dpost [T, n] and dcomb [T, n, n] (any may be undefined =
// zero), returns dx [T, n, D] (the path through mix and inv_rms) and accumulates into g.
Tensor mhc_mappings_backward(const Tensor& x, const MhcParams& p, const MhcConfig& c,
                             const MhcMappings& m, const Tensor& dpre, const Tensor& dpost,
                             const Tensor& dcomb, MhcParamGrads& g);

// Flat RMS: inv_rms [T] = 1/sqrt(mean over n*D of x^2 + eps). Backward: dx = -r^3 x / K * d_inv.
Tensor mhc_inv_rms(const Tensor& x, double eps);
Tensor mhc_inv_rms_backward(const Tensor& x, const Tensor& inv_rms, const Tensor& d_inv_rms);

// Sinkhorn on a batch of n x n logits [T, n, n] (the contract form above), and its backward
// (recomputes the iterations and differentiates through them): returns dlogits [T, n, n].
Tensor mhc_sinkhorn(const Tensor& logits, double hc_eps, int64_t iters);
Tensor mhc_sinkhorn_backward(const Tensor& logits, const Tensor& dcomb, double hc_eps,
                             int64_t iters);

// Collapse u [T, D] = sum_j pre_j X_j (X's dtype). Backward: dx_j = pre_j du, dpre_j = <du, X_j>.
Tensor mhc_collapse(const Tensor& x, const Tensor& pre);
struct MhcCollapseGrads {
  Tensor dx;    // [T, n, D]
  Tensor dpre;  // [T, n]
};
MhcCollapseGrads mhc_collapse_backward(const Tensor& x, const Tensor& pre, const Tensor& du);

// Inference: the collapse half of a site and the sublayer's RMSNorm in one pass (a decode step):
// the mappings, u = sum_j pre_j X_j in X's dtype and a = RMSNorm_w(u) = u rstd w, rstd =
// 1 / sqrt(mean(u^2) + norm_eps) (the RmsNorm module's math, in the computation dtype, rounded
// once to X's dtype). norm_w [D] floating. CPU: mhc_mappings_forward, mhc_collapse and
// rmsnorm_forward in turn (their bits). CUDA: two kernels (the composition takes four and a
// cuBLAS call): the projection fn @ flat and the sum of squares over slices of 256 elements of
// flat, a block per (slice, token), then a block per token for the slices' sums in order, the
// mappings (the composition's epilogue's operations, over one warp's lanes), the collapse and
// the norm. The projection's sums run
// in another order than cuBLAS's: agrees with the CPU within rounding. For a decode step's few
// tokens: every token reads the whole projection fn.
struct MhcCollapseNormed {
  Tensor a;     // [T, D] X's dtype
  Tensor pre;   // [T, n] computation dtype, as MhcMappings
  Tensor post;  // [T, n]
  Tensor comb;  // [T, n, n]
};
MhcCollapseNormed mhc_collapse_norm(const Tensor& x, const MhcParams& p, const MhcConfig& c,
                                    const Tensor& norm_w, double norm_eps);

// Write-back X'_i = post_i y + sum_j comb[j][i] X_j: x [T, n, D], y [T, D], post [T, n],
// comb [T, n, n]; result in X's dtype.
Tensor mhc_write_back(const Tensor& x, const Tensor& y, const Tensor& post, const Tensor& comb);
struct MhcWriteBackGrads {
  Tensor dx;     // [T, n, D]: dx_j = sum_i comb[j][i] dX'_i
  Tensor dy;     // [T, D]:    sum_i post_i dX'_i
  Tensor dpost;  // [T, n]:    <dX'_i, y>
  Tensor dcomb;  // [T, n, n]: dcomb[j][i] = <dX'_i, X_j>
};
MhcWriteBackGrads mhc_write_back_backward(const Tensor& x, const Tensor& y, const Tensor& post,
                                          const Tensor& comb, const Tensor& dx_out);

// Model level: expand e [T, D] to [T, n, D] (n copies); backward de = sum_j dX_j.
Tensor mhc_expand(const Tensor& e, int64_t n);
Tensor mhc_expand_backward(const Tensor& dx);
// Mean output contract h [T, D] = (1/n) sum_j X_j; backward dX_j = dh / n.
Tensor mhc_mean_contract(const Tensor& x);
Tensor mhc_mean_contract_backward(const Tensor& dh, int64_t n);

// ---- a whole site ----------------------------------------------------------------------------
//   MhcSiteSaved s;
//   Tensor u  = mhc_site_begin(x, params, cfg, s);   // the sublayer input
//   Tensor y  = sublayer(u);
//   Tensor xo = mhc_site_end(s, y);                   // the new streams
// backward:
//   Tensor dy = mhc_site_backward_dy(s, dxo);         // feed to the sublayer's backward -> du
//   Tensor dx = mhc_site_backward(s, dxo, du, grads); // dx [T, n, D]; grads +=
struct MhcSiteSaved {
  MhcConfig cfg;
  MhcParams params;
  Tensor x;  // [T, n, D] site input
  Tensor y;  // [T, D] sublayer output (set by mhc_site_end)
  MhcMappings maps;
};
Tensor mhc_site_begin(const Tensor& x, const MhcParams& p, const MhcConfig& c, MhcSiteSaved& s);
Tensor mhc_site_end(MhcSiteSaved& s, const Tensor& y);
Tensor mhc_site_backward_dy(const MhcSiteSaved& s, const Tensor& dx_out);
// dx = write-back path + collapse path + mapping path (the 3-way add, in that fixed order).
Tensor mhc_site_backward(const MhcSiteSaved& s, const Tensor& dx_out, const Tensor& du,
                         MhcParamGrads& g);

}  // namespace hlm::ops
