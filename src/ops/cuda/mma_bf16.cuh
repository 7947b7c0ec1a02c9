// Tensor-core products of BF16 operands with FP32 accumulation (sm_80 and later): mma.sync
// m16n8k16 and the ldmatrix loads of its fragments from shared memory. Internal.
//
// Fragments (lane = 4 g + t; two bf16 per 32-bit register, the lower index in the low half):
//   A (16 x 16, row-major): a0 (g, 2t..2t+1), a1 (g + 8, 2t..), a2 (g, 2t + 8..), a3 (g + 8, 2t
//   + 8..) B (16 x 8, k x n):      b0 (2t..2t+1, g), b1 (2t + 8..2t + 9, g) C, D (16 x 8, f32): d0
//   (g, 2t), d1 (g, 2t + 1), d2 (g + 8, 2t), d3 (g + 8, 2t + 1)
// ldmatrix.x4 loads four 8 x 8 b16 matrices whose rows (16 bytes each, 16-byte aligned) lanes
// 8 i .. 8 i + 7 address; register i of lane 4 g + t gets row g, elements 2t, 2t + 1 of matrix i
// (transposed: elements (2t, g), (2t + 1, g)). So for a row-major A tile at (r0, k0) with row
// stride ld, lane l addresses row r0 + l % 16, column k0 + 8 (l / 16) (a_frag_row below), and
// for B = X^T of a row-major X [n][k] (the key rows of attention scores), lane l addresses row
// n0 + l % 8, column k0 + 8 (l / 8): the four registers are b0, b1 of k steps k0 and k0 + 16.
// For B = X of a row-major X [k][n] (values), the transposed load at row k0 + l % 8 + 8 ((l / 8)
// % 2), column n0 + 8 (l / 16) gives b0, b1 of the n tiles n0 and n0 + 8.
// Rows whose stride is 16 bytes more than a multiple of 128 read conflict-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace hlm::ops::cuda {

// d += a b for one m16n8k16 tile.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4],
                                               const uint32_t (&b)[2]) {
#ifdef HLM_CUDA_EMU
  ::hlm::emu::mma_m16n8k16_bf16(d, a, b);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Four 8 x 8 b16 matrices from shared memory; `row` is this lane's row address.
template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#ifdef HLM_CUDA_EMU
  ::hlm::emu::ldmatrix_x4(r, row, kTrans);
#else
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s)
                 : "memory");
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s)
                 : "memory");
#endif
}

// Two floats as a bf16 pair (round to nearest even), x in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float x, float y) {
  const auto r = [](float v) -> uint32_t {
    const uint32_t u = __float_as_uint(v);
    if ((u & 0x7f800000u) == 0x7f800000u) return (u >> 16) | ((u & 0xffffu) ? 0x40u : 0u);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  };
  return r(x) | (r(y) << 16);
}

}  // namespace hlm::ops::cuda
