// AdamW kernels (train/cuda/adamw.cuh). The update is the CPU's formula element by element in FP64
// with the round-to-nearest intrinsics (__dmul_rn, __dadd_rn, ...), which nvcc never fuses into an
// FMA, so the results equal the CPU's bit for bit. The norm's block sums run a warp per block of
// elements, adding the squares in element order as the CPU does; the update is one launch for
// every parameter. Both take a table of the parameters (pointers, sizes, dtypes) on the device.
#include <cuda_runtime.h>

#include <cstring>

#include "ops/cuda/layer_ops_common.cuh"
#include "train/cuda/adamw.cuh"

namespace hlm::train::cuda {
namespace {

using ops::cuda::check_launch;

constexpr int kThreads = 256;
constexpr int64_t kChunk = 8192;  // elements per block of the update

// One gradient-norm block: elements [begin, end) of an f32 or f64 array.
struct NormBlock {
  const void* p;
  int64_t begin, end;
  int64_t f64;
};

// A warp per block. Each pass loads 256 elements (lane l holds begin + c + l + 32 j in v[j],
// coalesced) and adds their squares in element order: element 32 j + l comes from lane l by a
// shuffle, so every lane runs the CPU's sequential sum.
__global__ void block_sum_squares_kernel(const NormBlock* blocks, int64_t nblocks, double* out) {
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = int(threadIdx.x & 31);
  if (w >= nblocks) return;  // the whole warp
  const NormBlock b = blocks[w];
  double s = 0;
  for (int64_t c = b.begin; c < b.end; c += 256) {
    double v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t i = c + lane + 32 * j;
      v[j] = i >= b.end ? 0.0
             : b.f64    ? static_cast<const double*>(b.p)[i]
                        : double(static_cast<const float*>(b.p)[i]);
    }
    const int64_t cnt = b.end - c < 256 ? b.end - c : 256;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 32; ++l) {
        const double x = __shfl_sync(0xffffffffu, v[j], l);
        if (32 * j + l < cnt) s = __dadd_rn(s, __dmul_rn(x, x));
      }
  }
  if (lane == 0) out[w] = s;
}

// The update of element i (the CPU's expression, every operation rounded on its own).
template <class M, class G>
__device__ __forceinline__ void adamw_element(M* w, M* m, M* v, const G* g, int64_t i,
                                              const UpdateStep& st, double decay_mul) {
  const double gi = __dmul_rn(double(g[i]), st.scale);
  const M mi = M(__dadd_rn(__dmul_rn(st.b1, double(m[i])), __dmul_rn(__dadd_rn(1.0, -st.b1), gi)));
  const M vi = M(__dadd_rn(__dmul_rn(st.b2, double(v[i])),
                           __dmul_rn(__dmul_rn(__dadd_rn(1.0, -st.b2), gi), gi)));
  m[i] = mi;
  v[i] = vi;
  double wi = __dmul_rn(double(w[i]), decay_mul);
  const double denom = __dadd_rn(__dsqrt_rn(__ddiv_rn(double(vi), st.bc2)), st.eps);
  wi = __dadd_rn(wi, -__ddiv_rn(__dmul_rn(st.lr, __ddiv_rn(double(mi), st.bc1)), denom));
  w[i] = M(wi);
}

// One block per chunk of kChunk elements of one parameter (the chunk table lists every
// parameter's chunks): the dtypes are the parameter's, uniform over the block.
__global__ void adamw_kernel(const UpdateSlot* slots, const int64_t* chunks, UpdateStep st) {
  const int64_t slot = chunks[2 * int64_t(blockIdx.x)], begin = chunks[2 * int64_t(blockIdx.x) + 1];
  const UpdateSlot s = slots[slot];
  const int64_t end = begin + kChunk < s.n ? begin + kChunk : s.n;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    if (s.m_f64 != 0) {
      double *w = static_cast<double*>(s.w), *m = static_cast<double*>(s.m),
             *v = static_cast<double*>(s.v);
      if (s.g_f64 != 0)
        adamw_element(w, m, v, static_cast<const double*>(s.g), i, st, s.decay_mul);
      else
        adamw_element(w, m, v, static_cast<const float*>(s.g), i, st, s.decay_mul);
    } else {
      float *w = static_cast<float*>(s.w), *m = static_cast<float*>(s.m),
            *v = static_cast<float*>(s.v);
      if (s.g_f64 != 0)
        adamw_element(w, m, v, static_cast<const double*>(s.g), i, st, s.decay_mul);
      else
        adamw_element(w, m, v, static_cast<const float*>(s.g), i, st, s.decay_mul);
    }
  }
}

// A table of trivially copyable structs as a device tensor of i64 words.
template <class S>
Tensor device_table(const std::vector<S>& rows) {
  static_assert(sizeof(S) % sizeof(int64_t) == 0, "the table travels as i64 words");
  const int64_t words = int64_t(rows.size() * sizeof(S) / sizeof(int64_t));
  std::vector<int64_t> table(static_cast<size_t>(words));
  std::memcpy(table.data(), rows.data(), size_t(words) * sizeof(int64_t));
  return Tensor::from_vector<int64_t>({words}, table).to(Device::cuda);
}

}  // namespace

std::vector<double> block_sum_squares(const std::vector<const Tensor*>& gs, int64_t block) {
  std::vector<NormBlock> blocks;
  for (const Tensor* g : gs)
    for (int64_t b = 0; b < g->numel(); b += block)
      blocks.push_back({g->raw(), b, b + block < g->numel() ? b + block : g->numel(),
                        g->dtype() == DType::f64 ? 1 : 0});
  const int64_t nb = int64_t(blocks.size());
  if (nb == 0) return {};
  const Tensor dtable = device_table(blocks);
  Tensor out = Tensor::empty({nb}, DType::f64, Device::cuda);
  const int64_t warps_per_block = kThreads / 32;
  block_sum_squares_kernel<<<unsigned((nb + warps_per_block - 1) / warps_per_block), kThreads>>>(
      static_cast<const NormBlock*>(dtable.raw()), nb, static_cast<double*>(out.raw()));
  check_launch("AdamW gradient norm");
  return out.to_f64_vector();
}

void adamw_update(const std::vector<UpdateSlot>& slots, const UpdateStep& step) {
  std::vector<int64_t> chunks;  // (slot, first element) per block
  for (size_t k = 0; k < slots.size(); ++k)
    for (int64_t b = 0; b < slots[k].n; b += kChunk) {
      chunks.push_back(int64_t(k));
      chunks.push_back(b);
    }
  if (chunks.empty()) return;
  const int64_t nblocks = int64_t(chunks.size() / 2);
  HLM_CHECK(nblocks < (int64_t(1) << 31), "AdamW update: {} blocks exceed the grid limit", nblocks);
  const Tensor dslots = device_table(slots);
  const Tensor dchunks =
      Tensor::from_vector<int64_t>({int64_t(chunks.size())}, chunks).to(Device::cuda);
  adamw_kernel<<<unsigned(nblocks), kThreads>>>(static_cast<const UpdateSlot*>(dslots.raw()),
                                                static_cast<const int64_t*>(dchunks.raw()), step);
  check_launch("AdamW update");
}

}  // namespace hlm::train::cuda
