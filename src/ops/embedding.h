// Embedding lookup: out[..., :] = table[ids[...], :].
// table [V, D] (forward: any dtype, rows copied bit-exactly; backward: f32 or f64), ids of any
// shape, i64 or i32, each in [0, V) (else an error naming the position and the id).
// Backward accumulates dtable[ids[t], :] += dy[t, :] sequentially over tokens (deterministic).
// CUDA (ops/cuda/embedding.cu): the same dtype rules; ids i64 / i32 on the device, checked there
// (one small device-to-host copy: the first bad flat position, reported with the CPU's message).
// Forward is a gather of whole rows (bit-exact). Backward sorts the token positions by id (a
// stable radix sort, no atomics) and adds each touched row's tokens in increasing t, as the CPU
// does: f32 / f64 results are bit-identical to the CPU reference and run to run.
#pragma once

#include <span>

#include "core/tensor.h"

namespace hlm::ops {

// Returns [ids..., D] in the table's dtype.
Tensor embedding_forward(const Tensor& table, const Tensor& ids);
// The same, where the caller holds the ids' values on the host too (`host_ids`, in flat order:
// the values it uploaded): those are checked, on the host, instead of the device ids, so a CUDA
// lookup does not wait for the device. The caller answers for host_ids equalling ids.
Tensor embedding_forward(const Tensor& table, const Tensor& ids, std::span<const int64_t> host_ids);
// dy [ids..., D]; dtable [V, D] += the scattered rows.
void embedding_backward(const Tensor& dy, const Tensor& ids, Tensor& dtable);

}  // namespace hlm::ops
