// What every op's front door (ops/<op>.cpp) shares: output allocation with the NaN-poison test
// hook, and the switch from the front door to the CUDA launchers.
//
// An op is laid out as
//   ops/<op>.h         the public declaration (namespace hlm::ops)
//   ops/<op>.cpp       the front door: checks every argument (ops/op_checks.h), allocates the
//                      outputs (new_output), then switches on the device
//   ops/cpu/<op>.h     the CPU reference's entry points (namespace hlm::ops::cpu), and
//   ops/cpu/<op>.cpp   the reference itself: plain C++, no CUDA header, no HLM_HAVE_CUDA; it trusts
//                      its (checked, contiguous) inputs and writes the outputs it is given
//   ops/cuda/<op>.cuh  the CUDA side's host interface (namespace hlm::ops::cuda): params struct and
//                      launchers, includable from C++; and
//   ops/cuda/<op>.cu   the kernels and the launchers' definitions.
// A front door reaches CUDA only through HLM_CUDA_PATH, so a build without CUDA links and answers a
// CUDA tensor with a one-line error:
//
//   HLM_DISPATCH(op, x.device(), rmsnorm_forward, x, gate, w, eps, y, rstd);
//
// runs cpu::rmsnorm_forward(x, gate, w, eps, y, rstd) for CPU tensors and
// cuda::rmsnorm_forward(...) with the same arguments for CUDA tensors (an op whose two sides take
// different arguments writes the switch out, with HLM_CUDA_PATH in its CUDA case). An op with only
// its CPU reference so far calls detail::cpu_only(op, x, "x") (ops/op_checks.h), then the
// reference.
#pragma once

#include "core/tensor.h"

namespace hlm::ops {

// Test hook: while on, every output and workspace a front door or a CUDA launcher allocates (on
// any device) is filled with 0xFF bytes (NaN for floats, -1 for integers) before the
// implementation writes it, so an element an implementation forgets shows up.
void set_poison_outputs(bool on);
bool poison_outputs();

namespace detail {
// A new contiguous tensor on `dev` for an op to write, poisoned while the hook is on.
Tensor new_output(const Shape& shape, DType dt, Device dev);
}  // namespace detail

}  // namespace hlm::ops

#ifdef HLM_HAVE_CUDA
#define HLM_CUDA_PATH(op, ...) \
  do {                         \
    (void)(op);                \
    __VA_ARGS__;               \
  } while (0)
#else
#define HLM_CUDA_PATH(op, ...) \
  HLM_FAIL("{}: got a CUDA tensor, but this build has no CUDA support", op)
#endif

// The device switch of a front door whose CPU reference and CUDA launcher take the same arguments.
#define HLM_DISPATCH(op, dev, fn, ...)                      \
  do {                                                      \
    if ((dev) == ::hlm::Device::cpu) {                      \
      ::hlm::ops::cpu::fn(__VA_ARGS__);                     \
    } else {                                                \
      HLM_CUDA_PATH(op, ::hlm::ops::cuda::fn(__VA_ARGS__)); \
    }                                                       \
  } while (0)
