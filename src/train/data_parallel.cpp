// Data parallelism with a distributed optimizer (train/data_parallel.h).
#include "train/data_parallel.h"

#include <algorithm>
#include <cstring>
#include <set>

#include <fmt/format.h>

#include "core/device.h"
#include "core/error.h"
#include "dist/nccl_comm.h"

namespace hlm::train {
namespace {

Tensor rows(const Tensor& t, int64_t a, int64_t b) {
  return t.defined() ? t.slice(0, a, b).clone() : t;
}

// The master dtype AdamW keeps for a parameter (adamw.h): FP64 for f64 values, else FP32.
DType master_dtype(const Param& p) {
  return p.value.dtype() == DType::f64 ? DType::f64 : DType::f32;
}

// params without those in `drop`, in order.
std::vector<std::pair<std::string, Param*>> without(
    const std::vector<std::pair<std::string, Param*>>& params, const std::vector<Param*>& drop) {
  std::vector<std::pair<std::string, Param*>> v;
  for (const auto& np : params)
    if (std::find(drop.begin(), drop.end(), np.second) == drop.end()) v.push_back(np);
  return v;
}

}  // namespace

Batch shard_batch(const Batch& global, int rank, int size) {
  HLM_CHECK(size >= 1 && rank >= 0 && rank < size, "shard_batch: rank {} of {}", rank, size);
  if (size == 1) return global;
  const std::vector<int64_t> cu = global.cu_seqlens.to_i64_vector();
  const int64_t S = int64_t(cu.size()) - 1, T = cu.back();
  HLM_CHECK(S >= size,
            "data parallelism over {} processes needs at least {} sequences per step; this step's "
            "batch has {} (more sequences per step: raise tokens_per_step, or lower seq_len for a "
            "token stream)",
            size, size, S);
  // Boundary r: the sequence start nearest to r T / N, leaving every part at least one sequence.
  std::vector<int64_t> b(size_t(size) + 1, 0);
  b[size_t(size)] = S;
  for (int r = 1; r < size; ++r) {
    const int64_t lo = b[size_t(r - 1)] + 1, hi = S - (size - r);
    const double target = double(T) * double(r) / double(size);
    int64_t best = lo;
    for (int64_t q = lo; q <= hi; ++q)
      if (std::abs(double(cu[size_t(q)]) - target) < std::abs(double(cu[size_t(best)]) - target))
        best = q;
    b[size_t(r)] = best;
  }
  const int64_t q0 = b[size_t(rank)], q1 = b[size_t(rank) + 1];
  const int64_t t0 = cu[size_t(q0)], t1 = cu[size_t(q1)];
  Batch part;
  part.tokens = rows(global.tokens, t0, t1);
  part.targets = rows(global.targets, t0, t1);
  part.loss_mask = rows(global.loss_mask, t0, t1);
  std::vector<int64_t> pcu;
  for (int64_t q = q0; q <= q1; ++q) pcu.push_back(cu[size_t(q)] - t0);
  part.cu_seqlens = Tensor::from_vector({int64_t(pcu.size())}, pcu);
  part.eval_positions = Tensor::from_vector<int64_t>({0}, {});
  return part;
}

LossNormalizers global_normalizers(const Batch& global) {
  const std::vector<int64_t> cu = global.cu_seqlens.to_i64_vector();
  const std::vector<int64_t> tg = global.targets.to_i64_vector();
  LossNormalizers n;
  for (int64_t t : tg) n.lm += t != kIgnoreIndex;
  for (size_t q = 0; q + 1 < cu.size(); ++q) {
    n.sequences += cu[q + 1] > cu[q];
    for (int64_t i = cu[q]; i + 1 < cu[q + 1]; ++i) n.mtp += tg[size_t(i + 1)] != kIgnoreIndex;
  }
  return n;
}

ExpertGroups make_expert_groups(dist::Comm& world, int ep, bool gpu) {
  const int N = world.size(), r = world.rank();
  HLM_CHECK(ep >= 1 && N % ep == 0,
            "expert parallelism of {} over {} processes: the degree must divide the number of "
            "processes",
            ep, N);
  ExpertGroups g;
  g.ep = ep;
  g.experts = world.split(r / ep, r);
  g.data = world.split(r % ep, r);
  if (gpu) {
    g.experts_device = dist::nccl_comm(*g.experts);
    g.data_device = dist::nccl_comm(*g.data);
  }
  return g;
}

DataParallel::DataParallel(dist::Comm& comm, std::vector<std::pair<std::string, Param*>> params,
                           dist::Comm* device_comm, const ExpertGroups& groups,
                           const std::vector<Param*>& experts)
    : DataParallel(comm, without(params, experts), device_comm) {
  HLM_CHECK(groups.experts && groups.data && groups.experts->size() == groups.ep &&
                int64_t(groups.ep) * groups.data->size() == comm.size(),
            "data parallelism: expert groups of {} do not fit {} processes", groups.ep,
            comm.size());
  groups_ = &groups;
  std::vector<std::pair<std::string, Param*>> ex;
  for (const auto& np : params)
    if (std::find(experts.begin(), experts.end(), np.second) != experts.end()) {
      ex.push_back(np);
      expert_names_.insert(np.first);
    }
  HLM_CHECK(ex.size() == experts.size(),
            "data parallelism: {} of the {} expert weights are not among the parameters",
            experts.size() - ex.size(), experts.size());
  experts_ = std::make_unique<DataParallel>(*groups.data, std::move(ex), groups.data_device.get());
}

DataParallel::~DataParallel() = default;

DataParallel::DataParallel(dist::Comm& comm, std::vector<std::pair<std::string, Param*>> params,
                           dist::Comm* device_comm)
    : comm_(comm), device_comm_(device_comm), params_(std::move(params)) {
  const int N = comm_.size();
  HLM_CHECK(!device_comm_ || (device_comm_->size() == N && device_comm_->rank() == comm_.rank()),
            "data parallelism: the device communicator's ranks differ from the host's");
  int64_t total = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& [name, p] = params_[i];
    HLM_CHECK(p->value.is_contiguous(), "data parallelism: parameter '{}' is not contiguous ({})",
              name, p->value.describe());
    const DType g = master_dtype(*p);
    if (i == 0) grad_dtype_ = g;
    HLM_CHECK(g == grad_dtype_,
              "data parallelism: the parameters mix f64 with other dtypes ('{}' is {})", name,
              dtype_name(p->value.dtype()));
    offset_.push_back(total);
    total += p->value.numel();
  }
  // Contiguous runs of the parameter order, about total / N elements each.
  std::vector<int64_t> elems(size_t(N), 0), bytes(size_t(N), 0);
  for (size_t i = 0; i < params_.size(); ++i) {
    const int o = total > 0 ? int(std::min<int64_t>(N - 1, offset_[i] * N / total)) : 0;
    owner_.push_back(o);
    elems[size_t(o)] += params_[i].second->value.numel();
    bytes[size_t(o)] += int64_t(params_[i].second->value.nbytes());
  }
  seg_begin_.assign(size_t(N) + 1, int64_t(params_.size()));
  for (size_t i = params_.size(); i-- > 0;) seg_begin_[size_t(owner_[i])] = int64_t(i);
  for (int r = N - 1; r >= 0; --r)
    seg_begin_[size_t(r)] = std::min(seg_begin_[size_t(r)], seg_begin_[size_t(r) + 1]);
  seg_elems_ = *std::max_element(elems.begin(), elems.end());
  seg_bytes_ = *std::max_element(bytes.begin(), bytes.end());
}

dist::Comm& DataParallel::data_comm(Device* dev) const {
  *dev = params_.empty() ? Device::cpu : params_[0].second->value.device();
  for (const auto& [name, p] : params_)
    HLM_CHECK(p->value.device() == *dev && p->value.is_contiguous(),
              "data parallelism: parameter '{}' is {}, the first is on {}", name,
              p->value.describe(), device_name(*dev));
  if (*dev == Device::cpu) return comm_;
  HLM_CHECK(device_comm_ != nullptr && device_comm_->memory() == *dev,
            "data parallelism: the parameters are on {}, which needs a communicator of GPU "
            "memory (NCCL)",
            device_name(*dev));
  return *device_comm_;
}

int DataParallel::owner(size_t i) const {
  return owner_.at(i);
}

std::vector<std::pair<std::string, Param*>> DataParallel::owned() const {
  std::vector<std::pair<std::string, Param*>> v;
  for (size_t i = 0; i < params_.size(); ++i)
    if (owner_[i] == rank()) v.push_back(params_[i]);
  if (experts_)
    for (const auto& np : experts_->owned()) v.push_back(np);
  return v;
}

std::vector<Tensor> DataParallel::gather_experts(const std::vector<Tensor>& local) const {
  if (!groups_ || groups_->ep == 1) return rank() == 0 ? local : std::vector<Tensor>{};
  // Every expert-data group holds the same values: expert group 0's (the ranks of expert-data
  // rank 0) send theirs to its rank 0, world rank 0.
  if (groups_->data->rank() != 0) return {};
  dist::Comm& g = *groups_->experts;
  std::vector<Tensor> host;
  size_t bytes = 0;
  for (const Tensor& t : local) {
    host.push_back(t.to(Device::cpu).contiguous());
    bytes += host.back().nbytes();
  }
  constexpr int kTag = 7311;
  std::vector<uint8_t> msg(bytes);
  size_t at = 0;
  for (const Tensor& t : host) {
    std::memcpy(msg.data() + at, t.raw(), t.nbytes());
    at += t.nbytes();
  }
  if (g.rank() != 0) {
    if (bytes > 0) g.send_bytes(msg.data(), bytes, 0, kTag);
    return {};
  }
  std::vector<Tensor> whole;
  for (const Tensor& t : host) {
    HLM_CHECK(t.dim() >= 1, "expert parallelism: an expert tensor has no rows ({})", t.describe());
    Shape sh = t.shape();
    sh[0] *= groups_->ep;
    whole.push_back(Tensor::empty(sh, t.dtype()));
  }
  for (int q = 0; q < groups_->ep; ++q) {
    if (q > 0 && bytes > 0) g.recv_bytes(msg.data(), bytes, q, kTag);
    at = 0;
    for (size_t i = 0; i < host.size(); ++i) {
      const size_t n = host[i].nbytes();
      std::memcpy(static_cast<uint8_t*>(whole[i].raw()) + size_t(q) * n, msg.data() + at, n);
      at += n;
    }
  }
  return whole;
}

Tensor DataParallel::expert_share(const std::string& name, const Tensor& whole) const {
  if (!expert_names_.count(name)) return whole;
  const Param* p = nullptr;
  for (const auto& np : experts_->params_)
    if (np.first == name) p = np.second;
  const int64_t rows = p->value.size(0), ep = groups_->ep;
  Shape want = p->value.shape();
  want[0] *= ep;
  HLM_CHECK(whole.shape() == want, "expert tensor '{}' is {}, the model's experts need {}", name,
            whole.describe(), shape_str(want));
  const int64_t s = groups_->experts->rank();
  return whole.slice(0, s * rows, (s + 1) * rows);
}

void DataParallel::reduce_gradients() {
  const int N = size();
  Device dev;
  dist::Comm& dc = data_comm(&dev);
  const size_t es = dtype_size(grad_dtype_);
  Tensor buf = Tensor::zeros({int64_t(N) * seg_elems_}, grad_dtype_, dev);
  auto* base = static_cast<uint8_t*>(buf.raw());
  auto place = [&](size_t i) {  // parameter i's elements within its owner's segment
    const int o = owner_[i];
    return base + (size_t(o) * size_t(seg_elems_) +
                   size_t(offset_[i] - offset_[size_t(seg_begin_[size_t(o)])])) *
                      es;
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& [name, p] = params_[i];
    HLM_CHECK(p->grad.defined() && p->grad.device() == dev && p->grad.is_contiguous() &&
                  p->grad.dtype() == grad_dtype_ && p->grad.numel() == p->value.numel(),
              "data parallelism: parameter '{}' needs a contiguous {} gradient of {} values on "
              "{}, got {}",
              name, dtype_name(grad_dtype_), p->value.numel(), device_name(dev),
              p->grad.defined() ? p->grad.describe() : "none");
    device_copy(place(i), dev, p->grad.raw(), dev, p->grad.nbytes());
  }
  const Tensor mine = dc.reduce_scatter_sum(buf);
  const auto* src = static_cast<const uint8_t*>(mine.raw());
  const int64_t first = seg_begin_[size_t(rank())];
  for (int64_t i = first; i < seg_begin_[size_t(rank()) + 1]; ++i) {
    Param* p = params_[size_t(i)].second;
    device_copy(p->grad.raw(), dev, src + size_t(offset_[size_t(i)] - offset_[size_t(first)]) * es,
                dev, p->grad.nbytes());
  }
  if (experts_) experts_->reduce_gradients();
}

GradNorm DataParallel::grad_norm(const AdamW& shard) const {
  Tensor mine = Tensor::from_vector<double>({1}, {shard.grad_sum_squares()});
  const Tensor all = comm_.allgather(mine);
  double total = 0;
  for (double v : all.to_f64_vector()) total += v;  // rank order
  return shard.grad_norm_from(total);
}

void DataParallel::share_values() {
  const int N = size();
  Device dev;
  dist::Comm& dc = data_comm(&dev);
  // Byte buffers on the parameters' device: this rank's values, then every rank's.
  Tensor mine = Tensor::zeros({std::max<int64_t>(seg_bytes_, 1)}, DType::u8, dev);
  auto* m = static_cast<uint8_t*>(mine.raw());
  size_t at = 0;
  for (int64_t i = seg_begin_[size_t(rank())]; i < seg_begin_[size_t(rank()) + 1]; ++i) {
    const Tensor& v = params_[size_t(i)].second->value;
    device_copy(m + at, dev, v.raw(), dev, v.nbytes());
    at += v.nbytes();
  }
  Tensor all = Tensor::empty({std::max<int64_t>(int64_t(N) * seg_bytes_, 1)}, DType::u8, dev);
  const auto* a = static_cast<const uint8_t*>(all.raw());
  if (seg_bytes_ > 0) dc.allgather_bytes(m, size_t(seg_bytes_), all.raw());
  for (int r = 0; r < N; ++r) {
    if (r == rank()) continue;
    size_t off = size_t(r) * size_t(seg_bytes_);
    for (int64_t i = seg_begin_[size_t(r)]; i < seg_begin_[size_t(r) + 1]; ++i) {
      Tensor& v = params_[size_t(i)].second->value;
      device_copy(v.raw(), dev, a + off, dev, v.nbytes());
      off += v.nbytes();
    }
  }
  if (experts_) experts_->share_values();
}

safetensors::TensorMap DataParallel::gather_state(const AdamW& shard,
                                                  const std::string& prefix) const {
  const safetensors::TensorMap local = shard.state_dict(prefix);
  safetensors::TensorMap whole = gather_own_state(local, prefix);
  if (!experts_) return whole;
  // The experts' state: whole over each expert-data group at its rank 0 (the ranks of expert
  // group 0), then the shares stacked at world rank 0.
  const safetensors::TensorMap shares = experts_->gather_own_state(local, prefix);
  std::vector<std::string> keys;
  std::vector<Tensor> parts;
  for (const auto& np : experts_->params_)
    for (const char* k : AdamW::kStateKinds) {
      keys.push_back(prefix + k + np.first);
      if (!shares.empty()) parts.push_back(shares.at(keys.back()));
    }
  const std::vector<Tensor> stacked = gather_experts(parts);
  for (size_t i = 0; i < stacked.size(); ++i) whole[keys[i]] = stacked[i];
  return whole;
}

safetensors::TensorMap DataParallel::gather_own_state(const safetensors::TensorMap& local,
                                                      const std::string& prefix) const {
  constexpr int kTag = 7301;
  if (rank() != 0) {
    // This rank's tensors, in parameter order, as one message.
    std::vector<uint8_t> msg;
    for (int64_t i = seg_begin_[size_t(rank())]; i < seg_begin_[size_t(rank()) + 1]; ++i)
      for (const char* k : AdamW::kStateKinds) {
        const Tensor& t = local.at(prefix + k + params_[size_t(i)].first).contiguous();
        const auto* p = static_cast<const uint8_t*>(t.raw());
        msg.insert(msg.end(), p, p + t.nbytes());
      }
    uint64_t n = msg.size();
    comm_.send_bytes(&n, sizeof n, 0, kTag);
    if (n > 0) comm_.send_bytes(msg.data(), msg.size(), 0, kTag + 1);
    return {};
  }
  std::set<std::string> mine;
  for (int64_t i = seg_begin_[0]; i < seg_begin_[1]; ++i) mine.insert(params_[size_t(i)].first);
  safetensors::TensorMap whole;
  for (const auto& [k, t] : local)
    if (k == prefix + "step" || mine.count(AdamW::state_param(k, prefix))) whole[k] = t.clone();
  for (int r = 1; r < size(); ++r) {
    uint64_t n = 0;
    comm_.recv_bytes(&n, sizeof n, r, kTag);
    std::vector<uint8_t> msg(n);
    if (n > 0) comm_.recv_bytes(msg.data(), msg.size(), r, kTag + 1);
    size_t at = 0;
    for (int64_t i = seg_begin_[size_t(r)]; i < seg_begin_[size_t(r) + 1]; ++i) {
      const auto& [name, p] = params_[size_t(i)];
      for (const char* k : AdamW::kStateKinds) {
        Tensor t = Tensor::empty(p->value.shape(), master_dtype(*p));
        HLM_CHECK(at + t.nbytes() <= msg.size(),
                  "data parallelism: rank {}'s optimizer state is shorter than its parameters", r);
        std::memcpy(t.raw(), msg.data() + at, t.nbytes());
        at += t.nbytes();
        whole[prefix + k + name] = t;
      }
    }
    HLM_CHECK(at == msg.size(),
              "data parallelism: rank {}'s optimizer state is longer than its parameters", r);
  }
  return whole;
}

safetensors::TensorMap DataParallel::shard_state(const safetensors::TensorMap& whole,
                                                 const std::string& prefix) const {
  std::set<std::string> all, mine;
  for (size_t i = 0; i < params_.size(); ++i) {
    all.insert(params_[i].first);
    if (owner_[i] == rank()) mine.insert(params_[i].first);
  }
  safetensors::TensorMap part, experts;
  for (const auto& [key, t] : whole) {
    if (key.rfind(prefix, 0) != 0) continue;
    if (key == prefix + "step") {
      part[key] = t;
      experts[key] = t;
      continue;
    }
    const std::string name = AdamW::state_param(key, prefix);
    if (expert_names_.count(name)) {
      experts[key] = expert_share(name, t);
      continue;
    }
    HLM_CHECK(all.count(name), "optimizer state: unknown tensor '{}'", key);
    if (mine.count(name)) part[key] = t;
  }
  if (experts_)
    for (auto& [key, t] : experts_->shard_state(experts, prefix)) part[key] = t;
  return part;
}

void DataParallel::allreduce(std::vector<double>& v) const {
  Tensor t = Tensor::from_vector<double>({int64_t(v.size())}, v);
  comm_.allreduce_sum(t);
  v = t.to_f64_vector();
}

void DataParallel::allreduce(std::vector<int64_t>& v) const {
  Tensor t = Tensor::from_vector<int64_t>({int64_t(v.size())}, v);
  comm_.allreduce_sum(t);
  v = t.to_i64_vector();
}

}  // namespace hlm::train
