// The KDA decay gate on CUDA (ops/kda_gate.h), the math of ops/cpu/kda_gate.cpp, in FP32 (FP64
// when z is f64), with x = z + dt_bias[h, c] and eA = exp(A_log[h]) (1 without A_log):
//   standard:    g = -eA softplus(x)             dz = -eA sigmoid(x) dg,   dA_log += dg g
//   lower_bound: g = lb sigmoid(eA x)            dz = dg lb s(1-s) eA,     dA_log += dz x
// (s(1-s) as sigmoid(y) sigmoid(-y); 0 * inf := 0, so a saturated sigmoid gives no NaN).
// Forward: one thread per element. Backward: the tokens are cut into blocks of kTokBlock; one
// thread per (token block, column j = h K + c) writes dz for its tokens and sums dz and the dA_log
// summand over them in token order into workspaces [blocks, HV K]; one thread per column adds the
// blocks in order (d dt_bias[j] and a per-column dA_log sum), and one thread per head adds its K
// columns in order (dA_log[h]). Fixed orders, no atomics: bit-identical run to run.
#include "ops/cuda/kda_gate.cuh"
#include "ops/cuda/layer_ops_common.cuh"

namespace hlm::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kTokBlock = 32;

template <class A>
__device__ __forceinline__ A gate_softplus(A x) {
  return x > A(20) ? x : dlog1p(dexp(x));
}
template <class A>
__device__ __forceinline__ A mul0(A a, A b) {
  return (a == A(0) || b == A(0)) ? A(0) : a * b;
}

struct GateDims {
  int64_t T, HV, K;
  bool standard;
  double lb;
};

template <class TZ, class A>
__global__ void gate_fwd_kernel(const TZ* __restrict__ z, const A* __restrict__ A_log,
                                const A* __restrict__ dt_bias, A* __restrict__ g, GateDims d) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t cols = d.HV * d.K;
  if (i >= d.T * cols) return;
  const int64_t j = i % cols, h = j / d.K;
  const A eA = A_log ? dexp(A_log[h]) : A(1);
  const A x = ld<A>(z, i) + (dt_bias ? dt_bias[j] : A(0));
  g[i] = d.standard ? -mul0(eA, gate_softplus(x)) : A(d.lb) * dsigmoid(mul0(eA, x));
}

template <class TZ, class A>
__global__ void gate_bwd_kernel(const TZ* __restrict__ z, const A* __restrict__ A_log,
                                const A* __restrict__ dt_bias, const A* __restrict__ dg,
                                A* __restrict__ dz, A* __restrict__ part_db,
                                A* __restrict__ part_da, GateDims d) {
  const int64_t cols = d.HV * d.K;
  const int64_t j = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (j >= cols) return;
  const int64_t blk = blockIdx.x, t0 = blk * kTokBlock;
  const int64_t t1 = t0 + kTokBlock < d.T ? t0 + kTokBlock : d.T;
  const int64_t h = j / d.K;
  const A eA = A_log ? dexp(A_log[h]) : A(1);
  const A b = dt_bias ? dt_bias[j] : A(0);
  const A lb = A(d.lb);
  A sdb = 0, sda = 0;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t i = t * cols + j;
    const A x = ld<A>(z, i) + b;
    const A dy = dg[i];
    A dzi, dai;
    if (d.standard) {
      const A g = -mul0(eA, gate_softplus(x));
      dzi = -mul0(mul0(eA, dsigmoid(x)), dy);
      dai = mul0(dy, g);
    } else {
      const A y = mul0(eA, x);
      const A ds = dsigmoid(y) * dsigmoid(-y);
      dzi = mul0(mul0(dy * lb, ds), eA);
      dai = mul0(dzi, x);
    }
    dz[i] = dzi;
    sdb += dzi;
    sda += dai;
  }
  part_db[blk * cols + j] = sdb;
  part_da[blk * cols + j] = sda;
}

// ddt_bias[j] = sum of the blocks in order; cola[j] likewise for the dA_log summands.
template <class A>
__global__ void gate_col_reduce_kernel(const A* __restrict__ part_db, const A* __restrict__ part_da,
                                       A* __restrict__ ddt_bias, A* __restrict__ cola,
                                       int64_t blocks, int64_t cols) {
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= cols) return;
  A sb = 0, sa = 0;
  for (int64_t k = 0; k < blocks; ++k) sb += part_db[k * cols + j], sa += part_da[k * cols + j];
  if (ddt_bias) ddt_bias[j] = sb;
  cola[j] = sa;
}

template <class A>
__global__ void gate_head_reduce_kernel(const A* __restrict__ cola, A* __restrict__ dA_log,
                                        int64_t HV, int64_t K) {
  const int64_t h = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (h >= HV) return;
  A s = 0;
  for (int64_t c = 0; c < K; ++c) s += cola[h * K + c];
  dA_log[h] = s;
}

GateDims dims_of(const KdaGateArgs& a) {
  return {a.z.size(0), a.z.size(1), a.z.size(2), a.kind == KdaGateKind::standard, a.lower_bound};
}

// f(TZ{}, A{}) for z's storage type and the computation type.
template <class F>
void dispatch_gate(DType zt, F&& f) {
  dispatch_storage(zt, [&](auto tz) {
    using TZ = decltype(tz);
    f(tz, acc_t<TZ>{});
  });
}

}  // namespace

void kda_gate_forward(const KdaGateArgs& a, Tensor& g) {
  const GateDims d = dims_of(a);
  const int64_t n = d.T * d.HV * d.K;
  if (n == 0) return;
  dispatch_gate(a.z.dtype(), [&](auto tz, auto ta) {
    using TZ = decltype(tz);
    using A = decltype(ta);
    gate_fwd_kernel<TZ, A><<<blocks_for(n, kThreads), kThreads>>>(
        cptr<TZ>(a.z), cptr<A>(a.A_log), cptr<A>(a.dt_bias), mptr<A>(g), d);
    check_launch("kda_gate");
  });
}

void kda_gate_backward(const KdaGateArgs& a, const Tensor& dg, KdaGateGrads& r) {
  const GateDims d = dims_of(a);
  const int64_t cols = d.HV * d.K;
  const int64_t blocks = (d.T + kTokBlock - 1) / kTokBlock;
  dispatch_gate(a.z.dtype(), [&](auto tz, auto ta) {
    using TZ = decltype(tz);
    using A = decltype(ta);
    const DType adt = std::is_same_v<A, double> ? DType::f64 : DType::f32;
    const Tensor part_db = alloc({blocks, cols}, adt), part_da = alloc({blocks, cols}, adt);
    const Tensor cola = alloc({cols}, adt);
    if (blocks > 0 && cols > 0) {
      const dim3 grid(unsigned(blocks), blocks_for(cols, 128));
      gate_bwd_kernel<TZ, A><<<grid, 128>>>(cptr<TZ>(a.z), cptr<A>(a.A_log), cptr<A>(a.dt_bias),
                                            cptr<A>(dg), mptr<A>(r.dz), mptr<A>(part_db),
                                            mptr<A>(part_da), d);
      check_launch("kda_gate_backward");
    }
    if (cols > 0) {
      gate_col_reduce_kernel<A><<<blocks_for(cols, kThreads), kThreads>>>(
          cptr<A>(part_db), cptr<A>(part_da), r.ddt_bias.defined() ? mptr<A>(r.ddt_bias) : nullptr,
          mptr<A>(cola), blocks, cols);
      check_launch("kda_gate_backward column sums");
    }
    if (r.dA_log.defined() && d.HV > 0) {
      gate_head_reduce_kernel<A>
          <<<blocks_for(d.HV, 128), 128>>>(cptr<A>(cola), mptr<A>(r.dA_log), d.HV, d.K);
      check_launch("kda_gate_backward dA_log");
    }
  });
}

}  // namespace hlm::ops::cuda
