// Elementwise activations on CUDA (ops/activations.h), the formulas of ops/cpu/activations.cpp in
// FP32 (FP64 for f64): sigmoid, silu = x s, softplus = max(x, 0) + log1p(e^-|x|) and their
// derivatives s (1 - s), s (1 + x (1 - s)), s. Each thread handles V consecutive elements moved
// as one 16-byte access when the size and the pointers allow it (else V = 1), grid-stride.
#include <algorithm>
#include <initializer_list>

#include "ops/cuda/activations.cuh"
#include "ops/cuda/layer_ops_common.cuh"

namespace hlm::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 65536;

template <ActKind K, class A>
__device__ __forceinline__ A act_fwd(A x) {
  if constexpr (K == ActKind::sigmoid) {
    return dsigmoid(x);
  } else if constexpr (K == ActKind::silu) {
    return x * dsigmoid(x);
  } else {
    return (x > A(0) ? x : A(0)) + dlog1p(dexp(-fabs(x)));
  }
}

template <ActKind K, class A>
__device__ __forceinline__ A act_grad(A x) {
  const A s = dsigmoid(x);
  if constexpr (K == ActKind::sigmoid) {
    return s * (A(1) - s);
  } else if constexpr (K == ActKind::silu) {
    return s * (A(1) + x * (A(1) - s));
  } else {
    return s;
  }
}

// dy == nullptr: forward (out = act(x)); else backward (out = dy act'(x)).
template <ActKind K, int V, class T>
__global__ void act_kernel(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ out,
                           int64_t nvec) {
  using A = acc_t<T>;
  for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < nvec;
       v += int64_t(gridDim.x) * blockDim.x) {
    A xv[V], o[V];
    ldv<V>(x, v * V, xv);
    if (dy) {
      A dv[V];
      ldv<V>(dy, v * V, dv);
#pragma unroll
      for (int k = 0; k < V; ++k) o[k] = dv[k] * act_grad<K>(xv[k]);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) o[k] = act_fwd<K>(xv[k]);
    }
    stv<V>(out, v * V, o);
  }
}

template <ActKind K>
void launch(const Tensor& x, const Tensor* dy, Tensor& out) {
  const int64_t n = x.numel();
  if (n == 0) return;
  dispatch_storage(x.dtype(), [&](auto tx) {
    using T = decltype(tx);
    constexpr int VV = int(16 / sizeof(T));
    const T* pdy = dy ? cptr<T>(*dy) : nullptr;
    bool vec = n % VV == 0;
    for (const void* p : std::initializer_list<const void*>{x.raw(), pdy, out.raw()})
      vec = vec && reinterpret_cast<uintptr_t>(p) % 16 == 0;
    const int64_t nvec = vec ? n / VV : n;
    const unsigned blocks = std::min<unsigned>(blocks_for(nvec, kThreads), kMaxBlocks);
    if (vec) {
      act_kernel<K, VV, T><<<blocks, kThreads>>>(cptr<T>(x), pdy, mptr<T>(out), nvec);
    } else {
      act_kernel<K, 1, T><<<blocks, kThreads>>>(cptr<T>(x), pdy, mptr<T>(out), nvec);
    }
    check_launch("activation");
  });
}

template <class F>
void dispatch_act(ActKind a, F&& f) {
  switch (a) {
    case ActKind::sigmoid:
      f(std::integral_constant<ActKind, ActKind::sigmoid>{});
      return;
    case ActKind::silu:
      f(std::integral_constant<ActKind, ActKind::silu>{});
      return;
    default:
      f(std::integral_constant<ActKind, ActKind::softplus>{});
  }
}

}  // namespace

void activation_forward(ActKind act, const Tensor& x, Tensor& y) {
  dispatch_act(act, [&](auto k) { launch<decltype(k)::value>(x, nullptr, y); });
}

void activation_backward(ActKind act, const Tensor& x, const Tensor& dy, Tensor& dx) {
  dispatch_act(act, [&](auto k) { launch<decltype(k)::value>(x, &dy, dx); });
}

}  // namespace hlm::ops::cuda
