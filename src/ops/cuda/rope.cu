// RoPE on CUDA (ops/cuda/rope.cuh), the math of ops/cpu/rope.cpp:
//   pair i of every row of token t:  angle = pos[t] inv_freq[i] (in f64, or in the computation
//   dtype A), c = A(cos(angle)) factor, s = A(sin(angle)) factor (cos / sin in f64),
//   forward (a, b) -> (a c - b s, a s + b c), inverse (a, b) -> (a c + b s, -a s + b c).
// One 128-thread block per token t: first the rope_dim / 2 (c, s) pairs of t are computed once
// into shared memory (thread i for pairs i, i + 128, ...), shared by all n rows (heads) of t;
// then the block walks the n * L elements of t's rows with consecutive threads on consecutive
// elements (coalesced): the first element of a pair rotates the pair and writes both, the second
// one skips; channels outside the range are copied when y is not x. Each element is written by
// exactly one thread from inputs no other thread writes, so in-place runs are race free, and the
// result is one fixed expression per element (bit-identical run to run). No atomics.
// Faster: a token is L n elements (a few KB), so several tokens per block for small rows, 16-byte
// vector accesses, and fusing the rotation into the producing GEMM's epilogue would help; the op
// is memory bound (one read and one write per element; cos / sin cost O(T rope_dim)).
#include "ops/cuda/layer_ops_common.cuh"
#include "ops/cuda/rope.cuh"

namespace hlm::ops::cuda {
namespace {

constexpr int kThreads = 128;

template <class T>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(const T* x, T* y, const int64_t* __restrict__ pos,
                const double* __restrict__ inv_freq, int64_t n, int64_t L, int64_t off,
                int64_t half, bool interleave, bool inverse, bool angle_f64, double factor) {
  using A = acc_t<T>;
  extern __shared__ float4 smem4[];
  A* cs = reinterpret_cast<A*>(smem4);
  A* sn = cs + half;
  const int64_t t = blockIdx.x;
  const int64_t p = pos[t];
  const A fac = A(factor);
  for (int64_t i = threadIdx.x; i < half; i += kThreads) {
    const double ang = angle_f64 ? double(p) * inv_freq[i] : double(A(p) * A(inv_freq[i]));
    cs[i] = A(cos(ang)) * fac;
    sn[i] = A(sin(ang)) * fac;
  }
  __syncthreads();
  const int64_t base = t * n * L, len = n * L, dr = 2 * half;
  for (int64_t e = threadIdx.x; e < len; e += kThreads) {
    const int64_t c = e % L - off;  // channel within the rotated range
    if (c < 0 || c >= dr) {
      if (x != y) y[base + e] = x[base + e];
      continue;
    }
    int64_t i, ib;
    if (interleave) {
      if (c & 1) continue;
      i = c >> 1;
      ib = 1;
    } else {
      if (c >= half) continue;
      i = c;
      ib = half;
    }
    const A a = ld<A>(x, base + e), b = ld<A>(x, base + e + ib), cc = cs[i], ss = sn[i];
    A ya, yb;
    if (!inverse) {
      ya = a * cc - b * ss;
      yb = a * ss + b * cc;
    } else {
      ya = a * cc + b * ss;
      yb = -a * ss + b * cc;
    }
    st(y, base + e, ya);
    st(y, base + e + ib, yb);
  }
}

}  // namespace

void rope(const Tensor& x, const Tensor& pos, const Tensor& inv_freq, const RopeOptions& opt,
          Tensor& y) {
  const int64_t T = x.size(0), n = x.dim() == 3 ? x.size(1) : 1, L = x.size(-1);
  const int64_t half = opt.rope_dim / 2;
  if (T == 0 || n * L == 0) return;
  dispatch_storage(x.dtype(), [&](auto tx) {
    using T_ = decltype(tx);
    using A = acc_t<T_>;
    const size_t smem = size_t(2 * half) * sizeof(A);
    if (smem > 48 * 1024) set_smem(reinterpret_cast<const void*>(&rope_kernel<T_>), smem, "rope");
    rope_kernel<T_><<<unsigned(T), kThreads, smem>>>(
        cptr<T_>(x), mptr<T_>(y), cptr<int64_t>(pos), cptr<double>(inv_freq), n, L, opt.offset,
        half, opt.interleave, opt.inverse, opt.angle == RopeAngle::f64, opt.factor);
    check_launch("rope");
  });
}

}  // namespace hlm::ops::cuda
