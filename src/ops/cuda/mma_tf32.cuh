// Tensor-core products of FP32 operands held in shared memory (or registers): mma.sync
// m16n8k8 with TF32 operands and FP32 accumulation (sm_80 and later). Internal.
//
// Three precisions:
//   Prec::tf32    every operand rounded to TF32 (cvt.rna: 10-bit mantissa, relative error
//                 <= 2^-11 per operand).
//   Prec::tf32x3  every operand split x = hi + lo, hi = tf32(x), lo = tf32(x - hi), and
//                 a b ~ lo_a hi_b + hi_a lo_b + hi_a hi_b (three mma, small terms first): close
//                 to FP32 (~2^-22 relative per product, from the rounding of lo and the dropped
//                 lo_a lo_b term, against FP32's 2^-24).
//   Prec::fp32    no tensor cores: each lane sums its own accumulator elements with FP32 FMA in k
//                 order (the same fragment ownership, so callers do not change).
// Deterministic: the k steps and the three partial products always run in the same order, and
// every output element is accumulated by one thread.
//
// Operands are read through views: Mat{p, ld} is row-major (element (i, j) at p[i ld + j]),
// MatT{p, ld} the transpose of a row-major array (element (i, j) at p[j ld + i]). A product
// A B takes A as an (m, k) view and B as a (k, n) view, so A B^T of two row-major arrays is
// (Mat A, MatT B). Shared-memory banks of the fragment loads (lane = 4 g + t): an A = Mat or a
// B = MatT reads p[g ld + t], conflict-free for ld = 4 (mod 32); an A = MatT or a B = Mat reads
// p[t ld + g], conflict-free for ld = 8 (mod 32).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace hlm::ops::mma_cu {

enum class Prec { tf32, tf32x3, fp32 };

// The precision of the KDA kernels' products. f32 inputs: FP32 FMA, because 3xTF32 (2^-22 per
// product against FP32's 2^-24) measured 2.6e-5 on d dt_bias, a long sum with cancellation,
// against the FP32 path's 2e-5 bound. bf16 inputs: 3xTF32, or plain TF32 in the stages that
// the launch selects (kTf32Stages by default, kda_chunk/heuristics.h).
template <class Tin, bool kTf32 = false>
inline constexpr Prec prec_for = std::is_same_v<Tin, float> ? Prec::fp32
                                 : kTf32                    ? Prec::tf32
                                                            : Prec::tf32x3;

struct Mat {
  const float* p;
  int ld;
  __device__ __forceinline__ float operator()(int i, int j) const { return p[i * ld + j]; }
};
struct MatT {
  const float* p;
  int ld;
  __device__ __forceinline__ float operator()(int i, int j) const { return p[j * ld + i]; }
};

// Exact<View>: a view whose values are known to be exact in TF32 (e.g. bf16 inputs widened to
// f32: 8-bit mantissas). 3xTF32 then skips that operand's split and the product with its (zero)
// small part: the same sum, bit for bit (the skipped product adds exact zeros), one mma fewer.
template <class V>
struct Exact {
  V v;
  __device__ __forceinline__ float operator()(int i, int j) const { return v(i, j); }
};
template <class V>
struct is_exact : std::false_type {};
template <class V>
struct is_exact<Exact<V>> : std::true_type {};

// TF32 operands as the tensor core reads them: mma.sync ignores the low 13 bits of a TF32 operand
// register, so adding half a TF32 ulp (0x1000) to the bits of x rounds it to nearest, ties away
// from zero: cvt.rna.tf32.f32's rounding in an integer add instead of cvt's sequence. Inf and NaN
// pass unchanged: the add would turn Inf into NaN, and carry a NaN whose mantissa bits are all
// set (0x7fffffff, the NaN the GPU's own arithmetic produces) into the sign bit, a -0 operand that
// would hide the NaN from everything downstream (the non-finite checks of training included).
__device__ __forceinline__ uint32_t tf32_operand(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x7f800000u) == 0x7f800000u ? u : u + 0x1000u;
}
// The value of that rounding as an f32 (the low bits cleared): hi of the 3xTF32 split.
__device__ __forceinline__ float tf32_value(float x) {
  return __uint_as_float(tf32_operand(x) & 0xffffe000u);
}

// hi (and, for tf32x3, lo) TF32 parts of x; an exact x is its own hi (lo unused). The same
// operands, bit for bit, as cvt.rna of x and of x - tf32(x).
template <Prec P, bool kExact = false>
__device__ __forceinline__ void split(float x, uint32_t& hi, uint32_t& lo) {
  if constexpr (kExact) {
    hi = __float_as_uint(x);
    return;
  }
  if constexpr (P == Prec::tf32x3) {
    const float h = tf32_value(x);
    hi = __float_as_uint(h);
    lo = tf32_operand(x - h);
  } else {
    hi = tf32_operand(x);
  }
}

// d += a b for one m16n8k8 tile.
__device__ __forceinline__ void mma_m16n8k8(float (&d)[4], const uint32_t (&a)[4],
                                            const uint32_t (&b)[2]) {
#ifdef HLM_CUDA_EMU
  ::hlm::emu::mma_m16n8k8_tf32(d, a, b);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// The accumulator element (i, j, e) of a warp tile at (m0, n0) sits at row m0 + 16 i + g + 8 (e /
// 2) and column n0 + 8 j + 2 t + e % 2 of the output.
__device__ __forceinline__ int acc_row(int m0, int i, int e) {
  return m0 + 16 * i + ((threadIdx.x & 31) >> 2) + 8 * (e >> 1);
}
__device__ __forceinline__ int acc_col(int n0, int j, int e) {
  return n0 + 8 * j + 2 * (threadIdx.x & 3) + (e & 1);
}

// One k step's fragments, split: A rows r, r + 8 at columns k + t, k + t + 4 (t = lane % 4;
// r = the tile's first row + lane / 4), and B rows k + t, k + t + 4 at column c.
template <Prec P, class MA>
__device__ __forceinline__ void split_a(const MA& A, int r, int k, uint32_t (&hi)[4],
                                        uint32_t (&lo)[4]) {
  constexpr bool X = is_exact<MA>::value;
  const int t = threadIdx.x & 3;
  split<P, X>(A(r, k + t), hi[0], lo[0]);
  split<P, X>(A(r + 8, k + t), hi[1], lo[1]);
  split<P, X>(A(r, k + t + 4), hi[2], lo[2]);
  split<P, X>(A(r + 8, k + t + 4), hi[3], lo[3]);
}
template <Prec P, class MB>
__device__ __forceinline__ void split_b(const MB& B, int k, int c, uint32_t (&hi)[2],
                                        uint32_t (&lo)[2]) {
  constexpr bool X = is_exact<MB>::value;
  const int t = threadIdx.x & 3;
  split<P, X>(B(k + t, c), hi[0], lo[0]);
  split<P, X>(B(k + t + 4, c), hi[1], lo[1]);
}

// acc += A[m0 .. m0 + 16 WM)[k0 .. k1) B[k0 .. k1)[n0 .. n0 + 8 WN), k1 - k0 a multiple of 8.
// One warp (all 32 lanes, converged).
template <Prec P, int WM, int WN, class MA, class MB>
__device__ __forceinline__ void warp_mma(float (&acc)[WM][WN][4], const MA& A, const MB& B, int m0,
                                         int n0, int k0, int k1) {
  if constexpr (P == Prec::fp32) {
#pragma unroll
    for (int i = 0; i < WM; ++i)
#pragma unroll
      for (int j = 0; j < WN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = acc_row(m0, i, e), c = acc_col(n0, j, e);
          float x = acc[i][j][e];
          for (int k = k0; k < k1; ++k) x = fmaf(A(r, k), B(k, c), x);
          acc[i][j][e] = x;
        }
    return;
  }
  constexpr bool AX = is_exact<MA>::value, BX = is_exact<MB>::value;
  const int g = (threadIdx.x & 31) >> 2;
#pragma unroll 2
  for (int k = k0; k < k1; k += 8) {
    uint32_t ah[WM][4], al[WM][4], bh[WN][2], bl[WN][2];
#pragma unroll
    for (int i = 0; i < WM; ++i) split_a<P>(A, m0 + 16 * i + g, k, ah[i], al[i]);
#pragma unroll
    for (int j = 0; j < WN; ++j) split_b<P>(B, k, n0 + 8 * j + g, bh[j], bl[j]);
#pragma unroll
    for (int i = 0; i < WM; ++i)
#pragma unroll
      for (int j = 0; j < WN; ++j) {
        if constexpr (P == Prec::tf32x3) {
          if constexpr (!AX) mma_m16n8k8(acc[i][j], al[i], bh[j]);
          if constexpr (!BX) mma_m16n8k8(acc[i][j], ah[i], bl[j]);
        }
        mma_m16n8k8(acc[i][j], ah[i], bh[j]);
      }
  }
}

// acc1 += A1 B and acc2 += A2 B over the same rows, columns and k range: each B fragment is
// loaded and split once for both products. The same sums, bit for bit, as two warp_mma calls.
// The mma loop is written out rather than shared with warp_mma: the mma asm is volatile, so its
// order is kept as written, and interleaving the two accumulators keeps each one's three 3xTF32
// products from issuing back to back on one dependency chain.
template <Prec P, int WM, int WN, class MA1, class MA2, class MB>
__device__ __forceinline__ void warp_mma_pair(float (&acc1)[WM][WN][4], const MA1& A1,
                                              float (&acc2)[WM][WN][4], const MA2& A2, const MB& B,
                                              int m0, int n0, int k0, int k1) {
  if constexpr (P == Prec::fp32) {
    warp_mma<P>(acc1, A1, B, m0, n0, k0, k1);
    warp_mma<P>(acc2, A2, B, m0, n0, k0, k1);
    return;
  }
  constexpr bool AX1 = is_exact<MA1>::value, AX2 = is_exact<MA2>::value, BX = is_exact<MB>::value;
  const int g = (threadIdx.x & 31) >> 2;
#pragma unroll 2
  for (int k = k0; k < k1; k += 8) {
    uint32_t ah1[WM][4], al1[WM][4], ah2[WM][4], al2[WM][4], bh[WN][2], bl[WN][2];
#pragma unroll
    for (int i = 0; i < WM; ++i) {
      split_a<P>(A1, m0 + 16 * i + g, k, ah1[i], al1[i]);
      split_a<P>(A2, m0 + 16 * i + g, k, ah2[i], al2[i]);
    }
#pragma unroll
    for (int j = 0; j < WN; ++j) split_b<P>(B, k, n0 + 8 * j + g, bh[j], bl[j]);
#pragma unroll
    for (int i = 0; i < WM; ++i)
#pragma unroll
      for (int j = 0; j < WN; ++j) {
        if constexpr (P == Prec::tf32x3) {
          if constexpr (!AX1) mma_m16n8k8(acc1[i][j], al1[i], bh[j]);
          if constexpr (!BX) mma_m16n8k8(acc1[i][j], ah1[i], bl[j]);
          if constexpr (!AX2) mma_m16n8k8(acc2[i][j], al2[i], bh[j]);
          if constexpr (!BX) mma_m16n8k8(acc2[i][j], ah2[i], bl[j]);
        }
        mma_m16n8k8(acc1[i][j], ah1[i], bh[j]);
        mma_m16n8k8(acc2[i][j], ah2[i], bh[j]);
      }
  }
}

template <int WM, int WN>
__device__ __forceinline__ void zero(float (&acc)[WM][WN][4]) {
#pragma unroll
  for (int i = 0; i < WM; ++i)
#pragma unroll
    for (int j = 0; j < WN; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
}

// Calls f(row, col, value) for every element of a warp tile.
template <int WM, int WN, class F>
__device__ __forceinline__ void for_each(const float (&acc)[WM][WN][4], int m0, int n0, F&& f) {
#pragma unroll
  for (int i = 0; i < WM; ++i)
#pragma unroll
    for (int j = 0; j < WN; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(acc_row(m0, i, e), acc_col(n0, j, e), acc[i][j][e]);
}

// block_mma_kend: the whole block computes out = A B (M x N over Kd; M % (16 WM) == 0, N % (8 WN)
// == 0, Kd % 8 == 0): warp w takes the warp tiles w, w + nwarps, ... (row-major over the tile grid)
// and calls out(m, n, value) once per element. kend(m0) bounds the sum of the tile rows
// m0 .. m0 + 16 WM - 1 (a multiple of 8; e.g. a lower-triangular A: kend = m0 + 16 WM).
template <Prec P, int WM, int WN, class MA, class MB, class KEnd, class F>
__device__ __forceinline__ void block_mma_kend(int M, int N, const MA& A, const MB& B, KEnd&& kend,
                                               F&& out) {
  const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int tn = N / (8 * WN), tiles = (M / (16 * WM)) * tn;
  for (int tile = warp; tile < tiles; tile += nwarps) {
    const int m0 = (tile / tn) * 16 * WM, n0 = (tile % tn) * 8 * WN;
    float acc[WM][WN][4];
    zero(acc);
    warp_mma<P>(acc, A, B, m0, n0, 0, kend(m0));
    for_each(acc, m0, n0, out);
  }
}

// block_mma: the same over the full Kd.
template <Prec P, int WM, int WN, class MA, class MB, class F>
__device__ __forceinline__ void block_mma(int M, int N, int Kd, const MA& A, const MB& B, F&& out) {
  block_mma_kend<P, WM, WN>(
      M, N, A, B, [Kd](int) { return Kd; }, out);
}

}  // namespace hlm::ops::mma_cu
