// Small copy and elementwise ops that layers need on either device (CPU tensors run the plain
// loops of ops/cpu/tensor_ops.cpp, CUDA tensors the kernels of ops/cuda/tensor_ops.cu). They exist
// because Tensor's own copies (to(dtype), contiguous(), copy_) convert dtypes and gather strided
// views on the CPU only.
//
// Dtypes: f32, f64 and bf16 (conversions round to nearest even, once, from the source dtype).
// Every result is deterministic: each output element is written by one thread, reductions run in
// a fixed (ascending) order, so CPU and CUDA give the same bits for add_, add_bias_, sum_rows,
// scale_ and the conversions. CUDA kernels run on the default stream.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace hlm::ops {

// x itself when it already has dtype dt, else a new contiguous tensor of dt on x's device.
Tensor as_dtype(const Tensor& x, DType dt);
// x itself when it is contiguous, else a new contiguous copy on x's device (same dtype).
Tensor contiguous(const Tensor& x);
// dst = src (same shape; any strides on both sides; converts dtype). Both on one device, or
// different devices (then Tensor::copy_'s rules apply).
void copy_into(Tensor& dst, const Tensor& src);
// dst += src elementwise: same shape, dst contiguous f32 / f64, src of any float dtype and
// strides on dst's device (read as dst's dtype first); one addition per element.
void add_(Tensor& dst, const Tensor& src);
// y[t, o] += b[o] for a contiguous f32 / f64 y [T, O] and b [O] (read as y's dtype).
void add_bias_(Tensor& y, const Tensor& b);
// out[o] = sum_t x[t, o] for x [T, O] (read as dt; dt f32 / f64), summed over t in ascending order
// from 0. A new contiguous [O] tensor of dt on x's device.
Tensor sum_rows(const Tensor& x, DType dt);
// c = beta * c (beta == 0: c = 0 without reading it) for a 2-D f32 / f64 / bf16 c of any strides;
// the product is formed in f64 and rounded once to c's dtype.
void scale_(Tensor& c, double beta);
// Every element of t (contiguous f32 / f64 / bf16) set to NaN when flag[0] != 0 (flag an i32 [1]
// on t's device): a check made on the device and reported through the result, without the host
// reading the flag (on CUDA nothing waits).
void nan_if_flagged_(Tensor& t, const Tensor& flag);

// out[r, :] = src[rows[r], :]: the rows of a contiguous 2-D src [N, C] (any dtype, bytes copied)
// in the order given, as a new contiguous [R, C] tensor on src's device. rows are host indices,
// each in [0, N) (else an error naming the position and the index).
Tensor gather_rows(const Tensor& src, const std::vector<int64_t>& rows);
// dst[rows[r], :] = src[r, :]: the inverse, into a contiguous 2-D dst [N, C] of src's device and
// dtype (src [R, C], any strides: made contiguous first). rows are host indices, each in [0, N) and
// none twice (else an error naming the position and the index).
void scatter_rows(Tensor& dst, const std::vector<int64_t>& rows, const Tensor& src);

// The gradient of the final conv state that causal_conv1d_forward returns (conv1d.h), routed back
// to where each entry was copied from: final[n, i] is the input at local position
// p = L_n - (W-1) + i of sequence n, or, for p < 0, initial_state[n, p + W - 1].
//   dfinal [N, W-1, C] (any strides), dx [T, C] contiguous (+= at p >= 0),
//   dinitial [N, W-1, C] contiguous or nullptr (+= at p < 0; dropped when nullptr: zero state).
// cu: validated host cu_seqlens [N+1]. dfinal is read in dx's dtype (f32 / f64); one addition
// per element (no two entries of dfinal go to the same place).
void causal_conv1d_final_state_backward(const Tensor& dfinal, const std::vector<int64_t>& cu,
                                        int64_t width, Tensor& dx, Tensor* dinitial);

}  // namespace hlm::ops
