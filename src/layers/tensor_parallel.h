// Tensor parallelism: a layer's heads, or an MLP's intermediate channels, split over the ranks of
// a group (docs/parallel.md, "Tensor parallelism").
//
// Rank r of a group of n runs a layer of the same kind with 1/n of the heads (the config from
// kda_tp_config / dsa_tp_config / mlp_tp_config), whose parameters are slices of the whole
// layer's, laid out as Megatron lays out the KDA layer:
//   column-parallel (rows of the weight split): q_proj, k_proj, v_proj, the conv channels,
//     f_b_proj, g_b_proj (and its bias), b_proj, A_log, dt_bias; MLA's q_b_proj and kv_b_proj;
//     an MLP's gate_proj and up_proj;
//   row-parallel (columns of the weight split): o_proj; an MLP's down_proj;
//   replicated: the low-rank f_a_proj and g_a_proj, o_norm's weight; MLA's latent projections
//     and their norms;
//   identical: a DSA layer's indexer (every rank runs it whole on the same inputs).
// Every head's computation needs only its own slices, so the rank's layer computes its heads
// exactly as the whole layer does, and its output (o_proj or down_proj over its own columns) is a
// part of the whole: the sum of the n parts (dist::allreduce_from) is the layer's output. The
// backward is the mirror: each rank's dx is a part (the column-parallel projections' and the
// replicated projections' input gradients from its heads), summed the same way. A sliced
// parameter's gradient is the slice of the whole layer's gradient; a replicated one's is a part,
// and tp_reduce_grads sums those over the group; an identical one's is the whole layer's.
//
// The sums over ranks are Comm::allreduce_sum's (rank order: the same bits on every rank and run
// to run). The whole layer sums a row of o_proj in one GEMM; the parts split that sum, so the
// result differs from one process at rounding level (f64: ~1e-15; f32: ~1e-7 relative).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "dist/comm.h"
#include "layers/dsa/dsa_layer.h"
#include "layers/kda/kda_layer.h"
#include "layers/mlp.h"

namespace hlm {

enum class TpSplit : uint8_t {
  replicated,  // every rank holds the whole parameter; its gradient on a rank is a part
  identical,   // every rank holds it and computes the same gradient (a DSA layer's indexer)
  rows,        // dimension 0 split (column-parallel weights [out, in], per-channel vectors)
  cols,        // dimension 1 split (row-parallel weights [out, in])
};

// One parameter of a layer under tensor parallelism. The split dimension is a run of consecutive
// segments (one for a plain projection; q | k | v for a fused conv weight); each segment is cut
// into n equal parts, and rank r holds part r of every segment, in segment order.
struct TpParam {
  std::string name;  // relative to the layer, as Module::named_parameters gives it
  TpSplit split = TpSplit::replicated;
  std::vector<int64_t> segments;  // rows / cols only: the sizes, summing to the dimension
};

// Rank r's part of the whole parameter `full` (any device and dtype): a new contiguous CPU tensor
// of full's dtype (all of it for a replicated or identical parameter). Errors (hlm::Error) name the
// parameter: a rank outside [0, n), a shape whose split dimension is not the segments' sum, a
// segment not divisible by n.
Tensor tp_shard(const Tensor& full, const TpParam& p, int r, int n);
// The whole parameter from the n parts in rank order (the inverse of tp_shard; CPU, the parts'
// dtype). A replicated or identical parameter is parts[0] (the parts must agree in shape).
Tensor tp_unshard(const std::vector<Tensor>& parts, const TpParam& p);
// The whole parameter on every rank of the group from this rank's part (an all-gather).
Tensor tp_gather(dist::Comm& group, const Tensor& part, const TpParam& p);

// Every parameter of `layouts` in `shard` set to rank r's part of the same-named parameter of
// `whole` (values converted to the shard parameter's dtype and device). A missing name or a shape
// that does not match is an error naming the parameter; a parameter of `shard` that `layouts`
// does not list is an error too (nothing is set then).
void tp_load_shard(Module& whole, Module& shard, const std::vector<TpParam>& layouts, int r, int n);
// The replicated parameters' gradients of `shard` summed over the group (rank order), so every
// rank holds the whole layer's gradient of them (a sliced parameter's gradient is already its
// slice of the whole, an identical one's the whole). Parameters without a gradient are skipped.
void tp_reduce_grads(dist::Comm& group, Module& shard, const std::vector<TpParam>& layouts);

// The KDA layer of rank r's heads: num_heads / n qk heads and num_v_heads / n value heads, the
// rest as `whole` (the ranks of the low-rank gates are not split). n must divide num_heads (so
// also num_v_heads, a multiple of it); n >= 1.
KdaConfig kda_tp_config(const KdaConfig& whole, int n);
// The layout of every parameter of a KdaLayer built from `c` (any naming), one entry per
// parameter.
std::vector<TpParam> kda_tp_params(const KdaConfig& c);

// The MLP of rank r's channels: intermediate_size / n (n must divide it).
DenseMlpConfig mlp_tp_config(const DenseMlpConfig& whole, int n);
std::vector<TpParam> mlp_tp_params(const DenseMlpConfig& c);

// The MLA of rank r's heads: num_heads / n (n must divide it). The latent projections
// (q_a_proj, kv_a_proj_with_mqa) and their norms are replicated; q_b_proj (q_proj) and kv_b_proj
// are column-parallel by heads, o_proj row-parallel.
MlaConfig mla_tp_config(const MlaConfig& whole, int n);
std::vector<TpParam> mla_tp_params(const MlaConfig& c);
// A DSA layer: the MLA's layout, and every indexer parameter identical (each rank runs the whole
// indexer on the same inputs: the same selection and, with the loss target summed over the group
// (DsaLayer::set_tensor_parallel), the same loss and gradients).
DsaLayerConfig dsa_tp_config(const DsaLayerConfig& whole, int n);
std::vector<TpParam> dsa_tp_params(DsaLayer& layer);

}  // namespace hlm
