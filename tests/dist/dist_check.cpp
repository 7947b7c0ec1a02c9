// The collectives of dist/comm.h across real processes: run as `mpirun -np N hlm_dist_check`
// (tests/dist/dist_test.cpp launches it with N = 2 and 4). Every rank computes what every other
// rank sends (the inputs are functions of the rank), so each result is checked against the sum in
// rank order computed here, bit for bit, and the results are compared across ranks. With --nccl
// (tests/dist/nccl_gpu_test.cpp) the same collectives run again on the NCCL backend over GPU
// tensors (each rank on GPU local_rank % count; in the emulation build the NCCL stand-in), and
// each result must equal the host backend's bit for bit. Prints one line per rank and exits 0 when
// every check passed, 1 otherwise. `--train CONFIG OUT DEVICE [EP [CP [TP]]]` runs the trainer
// instead, `--kda-cp DTYPE DEVICE [short]` the KDA layer's context parallelism, `--moe-ep DTYPE
// DEVICE` the MoE layer's expert parallelism, `--model-cp DTYPE DEVICE [short]` the whole model's
// context parallelism, `--tp DTYPE DEVICE` the layers' tensor parallelism, `--model-tp DTYPE
// DEVICE` the whole model's and `--model-tpcp DTYPE DEVICE` the whole model's tensor and context
// parallelism together (below).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "core/rng.h"
#include "dist/comm.h"
#include "dist/context_parallel.h"
#include "dist/nccl_comm.h"
#include "layers/kda/kda_layer.h"
#include "layers/moe/moe_layer.h"
#include "layers/tensor_parallel.h"
#include "model/hybrid_model.h"
#include "train/trainer.h"

namespace {

using hlm::DType;
using hlm::Shape;
using hlm::Tensor;
using hlm::dist::Comm;

int failures = 0, checks = 0;

void expect(bool ok, const std::string& what, int rank) {
  ++checks;
  if (ok) return;
  ++failures;
  std::printf("dist_check: rank %d: FAILED %s\n", rank, what.c_str());
}

// Rank r's input: values of very different magnitudes so that the order of the sum shows.
double value(int r, int64_t i) {
  return std::sin(0.37 * double(i) + 1.3 * r) * std::pow(10.0, (r * 7 + i) % 5 - 2);
}

template <class T>
Tensor input(int r, int64_t n, DType dt) {
  std::vector<T> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[size_t(i)] = std::is_integral_v<T> ? T(int64_t(value(r, i) * 1000)) : T(value(r, i));
  return Tensor::from_vector<T>({n}, v);
}

// The sum over ranks 0..N-1 in that order, in T.
template <class T>
std::vector<T> ordered_sum(int N, int64_t n, DType dt) {
  std::vector<T> s(static_cast<size_t>(n));
  for (int r = 0; r < N; ++r) {
    const Tensor x = input<T>(r, n, dt);
    for (int64_t i = 0; i < n; ++i)
      s[size_t(i)] = r == 0 ? x.data<T>()[i] : s[size_t(i)] + x.data<T>()[i];
  }
  return s;
}

template <class T>
void check_allreduce(Comm& c, int64_t n, DType dt, const char* name) {
  Tensor t = input<T>(c.rank(), n, dt);
  c.allreduce_sum(t);
  const std::vector<T> want = ordered_sum<T>(c.size(), n, dt);
  // (memcmp is given no null pointer: an empty tensor has no storage.)
  expect(n == 0 || std::memcmp(t.raw(), want.data(), want.size() * sizeof(T)) == 0,
         std::string("allreduce_sum ") + name + " equals the rank-ordered sum", c.rank());
  // The same bits on every rank.
  const Tensor all = c.allgather(t);
  bool same = true;
  for (int r = 0; r < c.size() && n > 0; ++r)
    same = same && std::memcmp(all.data<T>() + r * n, t.raw(), t.nbytes()) == 0;
  expect(same, std::string("allreduce_sum ") + name + " is the same on every rank", c.rank());
}

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor x = a.is_cpu() ? a : a.to(hlm::Device::cpu);
  const Tensor y = b.is_cpu() ? b : b.to(hlm::Device::cpu);
  return x.shape() == y.shape() && x.dtype() == y.dtype() &&
         (x.nbytes() == 0 || std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0);
}

Tensor on_gpu(const Tensor& t) {
  return t.to(hlm::Device::cuda);
}

// The NCCL backend against the host one (w), on the same inputs.
void check_nccl(Comm& w) {
  const int R = w.rank(), N = w.size();
  std::unique_ptr<Comm> g = hlm::dist::nccl_comm(w);
  expect(g->rank() == R && g->size() == N && g->memory() == hlm::Device::cuda &&
             std::string(g->backend()) == "nccl",
         "the NCCL communicator has the host's ranks", R);
  for (int64_t n : {int64_t(1000), int64_t(1), int64_t(N * 37), int64_t(0)}) {
    for (DType dt : {DType::f32, DType::f64}) {
      Tensor h = dt == DType::f32 ? input<float>(R, n, dt) : input<double>(R, n, dt);
      Tensor d = on_gpu(h);
      w.allreduce_sum(h);
      g->allreduce_sum(d);
      expect(same_bits(d, h), "nccl allreduce_sum " + std::to_string(n) + " equals the host's", R);
    }
  }
  {
    const int64_t m = 5, n = N * m * 3;
    const Tensor t = input<float>(R, n, DType::f32).view({N * m, 3});
    expect(same_bits(g->reduce_scatter_sum(on_gpu(t)), w.reduce_scatter_sum(t)),
           "nccl reduce_scatter_sum equals the host's", R);
    const Tensor a = input<double>(R, 6, DType::f64).view({2, 3});
    expect(same_bits(g->allgather(on_gpu(a)), w.allgather(a)), "nccl allgather equals the host's",
           R);
    Tensor b = input<double>(R, 7, DType::f64), bd = on_gpu(b);
    w.broadcast(b, N - 1);
    g->broadcast(bd, N - 1);
    expect(same_bits(bd, b), "nccl broadcast from the last rank equals the host's", R);
  }
  {
    std::vector<int64_t> send(static_cast<size_t>(N) * 4);
    for (int q = 0; q < N; ++q)
      for (int j = 0; j < 4; ++j) send[size_t(q * 4 + j)] = 1000 * R + q + 100 * j;
    const Tensor s = Tensor::from_vector<int64_t>({int64_t(send.size())}, send);
    Tensor sd = on_gpu(s), rd = on_gpu(s);
    g->alltoall_bytes(sd.raw(), 4 * sizeof(int64_t), rd.raw());
    const Tensor r = rd.to(hlm::Device::cpu);
    bool ok = true;
    for (int src = 0; src < N; ++src)
      for (int j = 0; j < 4; ++j)
        ok = ok && r.data<int64_t>()[src * 4 + j] == 1000 * src + R + 100 * j;
    expect(ok, "nccl alltoall_bytes delivers block r of every rank to rank r", R);
    // The tensor all-to-all on the GPU, and a host tensor through it (alltoall_from).
    const Tensor t = s.view({int64_t(N), 4});
    expect(same_bits(g->alltoall(on_gpu(t)), w.alltoall(t)), "nccl alltoall equals the host's", R);
    const Tensor via = hlm::dist::alltoall_from(*g, t);
    expect(via.is_cpu() && same_bits(via, w.alltoall(t)),
           "a host tensor's alltoall through nccl comes back to the host, the host's bits", R);
  }
  {
    std::vector<int64_t> send_rows, recv_rows;
    for (int q = 0; q < N; ++q) {
      send_rows.push_back((R + 2 * q) % 3);
      recv_rows.push_back((q + 2 * R) % 3);
    }
    int64_t n = 0;
    for (int64_t r : send_rows) n += r;
    const Tensor t = input<float>(R, n * 5, DType::f32).view({n, 5});
    expect(same_bits(g->alltoallv(on_gpu(t), send_rows, recv_rows),
                     w.alltoallv(t, send_rows, recv_rows)),
           "nccl alltoallv equals the host's", R);
  }
  if (N > 1) {
    const int next = (R + 1) % N, prev = (R + N - 1) % N;
    Tensor out = on_gpu(Tensor::from_vector<int64_t>({1}, {77 * R + 5}));
    Tensor in = on_gpu(Tensor::from_vector<int64_t>({1}, {-1}));
    if (R % 2 == 0) {
      g->send_bytes(out.raw(), 8, next, 0);
      g->recv_bytes(in.raw(), 8, prev, 0);
    } else {
      g->recv_bytes(in.raw(), 8, prev, 0);
      g->send_bytes(out.raw(), 8, next, 0);
    }
    expect(in.to(hlm::Device::cpu).data<int64_t>()[0] == 77 * prev + 5,
           "nccl send / recv around the ring", R);
  }
  {
    std::unique_ptr<Comm> sub = g->split(R % 2, R);
    Tensor t = on_gpu(Tensor::from_vector<double>({1}, {double(R) + 0.25}));
    sub->allreduce_sum(t);
    double want = 0;
    for (int r = R % 2; r < N; r += 2) want += double(r) + 0.25;
    expect(sub->size() == (N - R % 2 + 1) / 2 && t.to(hlm::Device::cpu).data<double>()[0] == want,
           "nccl allreduce_sum within a group of split", R);
  }
  {
    // Integer sums (counts) on the GPU, exact beyond f64's 2^53.
    const int64_t big = (int64_t(1) << 60) + 1;
    Tensor t = on_gpu(Tensor::from_vector<int64_t>({3}, {big, int64_t(R), -int64_t(R)}));
    g->allreduce_sum(t);
    const std::vector<int64_t> v = t.to(hlm::Device::cpu).to_i64_vector();
    expect(v[0] == big * N && v[1] == int64_t(N) * (N - 1) / 2 && v[2] == -v[1],
           "nccl allreduce_sum of i64 tensors is exact", R);
  }
  g->barrier();
}

}  // namespace

// `--train CONFIG OUT DEVICE [EP [CP [TP]]]` (cpu or cuda): the trainer (train/trainer.h) on a
// training config, data parallel over the processes of the job (expert parallel over groups of
// EP, context parallel over groups of CP), or tensor parallel over all of them (TP), as
// `hybridlm train [--expert-parallel EP] [--context-parallel CP] [--tensor-parallel TP]` runs it
// (tests/dist/data_parallel_gpu_test.cpp: the emulation build then needs no command-line tool).
int train(const std::string& config, const std::string& out, const std::string& device, int ep,
          int cp, int tp) {
  Comm& w = hlm::dist::world();
  hlm::train::TrainConfig cfg =
      hlm::train::make_train_config(hlm::train::read_train_config_file(config), {}, config,
                                    std::filesystem::path(config).parent_path().string());
  hlm::train::TrainerOptions o;
  o.out_dir = out;
  o.device = device == "cuda" ? hlm::Device::cuda : hlm::Device::cpu;
  o.comm = w.size() > 1 ? &w : nullptr;
  o.expert_parallel = ep;
  o.context_parallel = cp;
  o.tensor_parallel = tp;
  o.plot = false;
  hlm::train::Trainer(cfg, o).run();
  return 0;
}

// max |a - b| / max |b| over two tensors of one shape (on the host, in f64).
double rel_err(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(hlm::Device::cpu).to(DType::f64), y = b.to(hlm::Device::cpu).to(DType::f64);
  if (x.shape() != y.shape()) return INFINITY;
  double num = 0, den = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    num = std::max(num, std::abs(x.data<double>()[i] - y.data<double>()[i]));
    den = std::max(den, std::abs(y.data<double>()[i]));
  }
  return den > 0 ? num / den : num;
}

// The DTYPE (f64 or f32) and DEVICE (cpu or cuda) of a layer check; on cuda this rank takes GPU
// local_rank % count.
std::pair<DType, hlm::Device> layer_check_args(const char* flag, const std::string& dtype,
                                               const std::string& device) {
  HLM_CHECK(dtype == "f64" || dtype == "f32", "{}: DTYPE must be f64 or f32, got '{}'", flag,
            dtype);
  HLM_CHECK(device == "cpu" || device == "cuda", "{}: DEVICE must be cpu or cuda, got '{}'", flag,
            device);
  const hlm::Device dev = device == "cuda" ? hlm::Device::cuda : hlm::Device::cpu;
  if (dev == hlm::Device::cuda) {
    HLM_CHECK(hlm::cuda_device_count() > 0, "{}: no CUDA device is present", flag);
    hlm::cuda_select_device(hlm::dist::local_rank() % hlm::cuda_device_count());
  }
  return {dtype == "f64" ? DType::f64 : DType::f32, dev};
}

// [T, D] of U(-1, 1) draws from rng (on the host, in draw order), on dev.
Tensor random_rows(int64_t T, int64_t D, DType dt, hlm::Device dev, hlm::Rng& rng) {
  Tensor t = Tensor::empty({T, D}, dt);
  rng.fill_uniform(t, -1, 1);
  return t.to(dev);
}

// T random token ids below V and their targets (every 7th, from the 4th, ignored: -100), i64.
std::pair<Tensor, Tensor> random_tokens(int64_t T, int64_t V, hlm::Rng& rng) {
  std::vector<int64_t> tok(static_cast<size_t>(T)), tgt(static_cast<size_t>(T));
  for (auto& t : tok) t = int64_t(rng.next_u64() % uint64_t(V));
  for (int64_t t = 0; t < T; ++t)
    tgt[size_t(t)] = t % 7 == 3 ? -100 : int64_t(rng.next_u64() % uint64_t(V));
  return {Tensor::from_vector<int64_t>({T}, tok), Tensor::from_vector<int64_t>({T}, tgt)};
}

// `--kda-cp DTYPE DEVICE [short]` (f64 or f32; cpu or cuda): KdaLayer's context parallelism,
// chunkwise and (when the group's size divides its 4 heads) headwise (layers/kda/kda_layer.h), over
// this job's ranks against the whole batch run in this process, on packed batches whose slice
// bounds fall inside sequences, at their starts, and around a rank of fewer tokens than the conv's
// W-1 (tests/dist/context_parallel_test.cpp): the output and input gradient of every slice, and the
// parameter gradients summed over the ranks, within 1e-10 (f64) or 5e-5 (f32) of the whole
// batch's (max error over max value); the same bits when run again, and with selective
// recompute. `short` leaves out the five-sequence batch (the emulated GPU's run). Prints the worst
// errors per rank.
int kda_cp(const std::string& dtype, const std::string& device, bool all_cases) {
  const auto [dt, dev] = layer_check_args("--kda-cp", dtype, device);
  const double tol = dt == DType::f64 ? 1e-10 : 5e-5;
  Comm& w = hlm::dist::world();
  const int R = w.rank(), N = w.size();
  hlm::KdaConfig c;
  c.hidden_size = 48;
  c.num_heads = 4;
  c.num_v_heads = 8;
  c.head_k_dim = c.head_v_dim = 32;
  c.decay_rank = c.output_gate_rank = 8;
  hlm::PrecisionPolicy policy;  // GEMMs in the dtype (not rounded to bf16)
  policy.default_kind = hlm::GemmKind::native;
  hlm::KdaLayer layer(c, policy, "kda", dt);
  hlm::Rng rng(2026, 3);
  layer.init_weights(rng.next_u64());
  rng.fill_uniform(layer.A_log().value, -0.5, 1.0);
  rng.fill_uniform(layer.dt_bias().value, -1.0, 1.0);
  rng.fill_uniform(layer.o_norm_weight().value, 0.5, 1.5);
  layer.to(dev);
  const auto params = layer.named_parameters();

  // (sequence lengths, slice bounds or empty for the even split)
  struct Case {
    const char* name;
    std::vector<int64_t> lengths, bounds;
  };
  std::vector<Case> cases = {{"one sequence, even split", {300}, {}}};
  if (all_cases) cases.push_back({"five sequences, even split", {150, 7, 200, 2, 90}, {}});
  // Bounds at a sequence start, and a slice of one token inside a 3-token sequence (its
  // neighbours' conv inputs then come from two ranks).
  if (N == 2) cases.push_back({"bound at a sequence start", {70, 3, 100}, {0, 70, 173}});
  if (N == 3) cases.push_back({"a one-token slice", {70, 3, 100}, {0, 71, 72, 173}});
  if (N == 4) cases.push_back({"a one-token slice", {70, 3, 100}, {0, 71, 72, 130, 173}});
  std::vector<hlm::KdaCpMode> modes{hlm::KdaCpMode::chunkwise};
  if (c.num_heads % N == 0) modes.push_back(hlm::KdaCpMode::headwise);
  double worst = 0;
  for (const Case& k : cases) {
    const hlm::SeqLayout seqs = hlm::SeqLayout::from_lengths(k.lengths);
    const int64_t T = seqs.total_tokens();
    const std::vector<int64_t> bounds =
        k.bounds.empty() ? hlm::dist::CpSlice::even_bounds(T, N) : k.bounds;
    const Tensor x = random_rows(T, c.hidden_size, dt, dev, rng);
    const Tensor dy = random_rows(T, c.hidden_size, dt, dev, rng);
    const hlm::Context ctx{true, false};
    // The whole batch here.
    layer.zero_grad();
    hlm::KdaLayer::Saved sr;
    const Tensor y_ref = layer.forward(ctx, x, seqs, nullptr, &sr);
    const Tensor dx_ref = layer.backward(ctx, dy, sr).dx;
    std::vector<Tensor> g_ref;
    for (const auto& [name, p] : params) g_ref.push_back(p->grad.to(hlm::Device::cpu));
    // This rank's slice.
    const hlm::dist::CpSlice slice(w, seqs, bounds);
    const int64_t b0 = slice.begin(R), b1 = slice.end(R);
    for (const hlm::KdaCpMode mode : modes) {
      const std::string what = std::string(k.name) + ", " +
                               (mode == hlm::KdaCpMode::headwise ? "headwise" : "chunkwise");
      auto run = [&](bool recompute, Tensor& y, Tensor& dx, std::vector<Tensor>& g) {
        layer.zero_grad();
        hlm::KdaLayer::Saved s;
        const hlm::Context cx{true, recompute};
        y = layer.forward(cx, x.slice(0, b0, b1).contiguous(), slice, &s, mode);
        dx = layer.backward(cx, dy.slice(0, b0, b1).contiguous(), s).dx;
        g.clear();
        for (const auto& [name, p] : params) {
          Tensor h = p->grad.to(hlm::Device::cpu);
          w.allreduce_sum(h);
          g.push_back(h);
        }
      };
      Tensor y, dx, y2, dx2, y3, dx3;
      std::vector<Tensor> g, g2, g3;
      run(false, y, dx, g);
      run(false, y2, dx2, g2);
      run(true, y3, dx3, g3);
      const double ey = rel_err(y, y_ref.slice(0, b0, b1)),
                   ex = rel_err(dx, dx_ref.slice(0, b0, b1));
      double eg = 0;
      std::string worst_param;
      bool same = same_bits(y, y2) && same_bits(dx, dx2) && same_bits(y, y3) && same_bits(dx, dx3);
      for (size_t i = 0; i < params.size(); ++i) {
        const double e = rel_err(g[i], g_ref[i]);
        if (!(e <= tol)) expect(false, what + ": gradient of " + params[i].first, R);
        if (e > eg) eg = e, worst_param = params[i].first;
        same = same && same_bits(g[i], g2[i]) && same_bits(g[i], g3[i]);
      }
      expect(ey <= tol, what + ": the slice's output", R);
      expect(ex <= tol, what + ": the slice's input gradient", R);
      expect(same, what + ": the same bits run again and with recompute", R);
      std::printf("kda_cp: rank %d of %d (%s %s): %s: y %.2e, dx %.2e, grads %.2e (%s)\n", R, N,
                  dtype.c_str(), device.c_str(), what.c_str(), ey, ex, eg, worst_param.c_str());
      worst = std::max({worst, ey, ex, eg});
    }
  }
  w.barrier();
  std::printf("kda_cp: rank %d of %d: worst %.2e (tolerance %.0e): %d of %d checks passed\n", R, N,
              worst, tol, checks - failures, checks);
  return failures == 0 ? 0 : 1;
}

// `--moe-ep DTYPE DEVICE` (f64 or f32; cpu or cuda): MoeLayer's expert parallelism
// (layers/moe/moe_layer.h) over this job's ranks, each with its own tokens (rank r: 9 + 7 r, so
// the all-to-alls move runs of different sizes), against one layer of every expert run on all
// ranks' tokens in this process: each rank's experts hold the whole layer's values bit for bit;
// the output and input gradient of each rank's tokens; the routed experts' gradients on the rank
// that holds them, and the router's and the shared expert's summed over the ranks, within 1e-12
// (f64) or 1e-5 (f32) (max error over max value); the same bits run again and with selective
// recompute (tests/dist/expert_parallel_test.cpp).
int moe_ep(const std::string& dtype, const std::string& device) {
  const auto [dt, dev] = layer_check_args("--moe-ep", dtype, device);
  const double tol = dt == DType::f64 ? 1e-12 : 1e-5;
  Comm& w = hlm::dist::world();
  const int R = w.rank(), N = w.size();
  hlm::MoeConfig c;
  c.hidden_size = 24;
  c.n_experts = 8;
  c.top_k = 3;
  c.moe_intermediate_size = 12;
  c.n_shared_experts = 1;
  c.dtype = dt;
  c.seed = 11;
  c.init_std = 0.2;
  hlm::PrecisionPolicy policy;  // GEMMs in the dtype (not rounded to bf16)
  policy.default_kind = hlm::GemmKind::native;
  hlm::MoeLayer whole(c, policy, "mlp");
  hlm::MoeConfig ce = c;
  ce.ep_size = N;
  ce.ep_rank = R;
  hlm::MoeLayer part(ce, policy, "mlp");
  const int64_t El = ce.local_experts(), e0 = ce.first_expert();
  bool same_init = true;
  for (const auto& [name, p] : part.named_parameters()) {
    const Tensor& v = whole.find_parameter(name)->value;
    same_init = same_init && same_bits(p->value, name.rfind("experts.", 0) == 0
                                                     ? v.slice(0, e0, e0 + El).contiguous()
                                                     : v);
  }
  expect(same_init, "this rank's experts hold the whole layer's values", R);
  whole.to(dev);
  part.to(dev);
  // The tokens: rank r's are rows [b_r, b_{r+1}) of the whole batch.
  std::vector<int64_t> b{0};
  for (int r = 0; r < N; ++r) b.push_back(b.back() + 9 + 7 * r);
  const int64_t T = b.back(), b0 = b[size_t(R)], b1 = b[size_t(R) + 1];
  hlm::Rng rng(5, 1);
  const Tensor x = random_rows(T, c.hidden_size, dt, dev, rng);
  const Tensor dy = random_rows(T, c.hidden_size, dt, dev, rng);
  const hlm::Context ctx{true, false};
  whole.zero_grad();
  hlm::MoeLayer::Saved sw;
  const Tensor y_ref = whole.forward(ctx, x, hlm::SeqLayout::single(T), &sw).y;
  const Tensor dx_ref = whole.backward(ctx, dy, sw);
  auto run = [&](bool recompute, Tensor& y, Tensor& dx, std::vector<Tensor>& g) {
    part.zero_grad();
    hlm::MoeLayer::Saved s;
    const hlm::Context cx{true, recompute};
    const Tensor xs = x.slice(0, b0, b1).contiguous();
    y = part.forward(cx, xs, hlm::SeqLayout::single(b1 - b0), &s, Tensor(), N > 1 ? &w : nullptr).y;
    dx = part.backward(cx, dy.slice(0, b0, b1).contiguous(), s);
    g.clear();
    for (const auto& [name, p] : part.named_parameters()) {
      Tensor h = p->grad.to(hlm::Device::cpu);
      if (name.rfind("experts.", 0) != 0) w.allreduce_sum(h);  // the replicated parameters
      g.push_back(h);
    }
  };
  Tensor y, dx, y2, dx2, y3, dx3;
  std::vector<Tensor> g, g2, g3;
  run(false, y, dx, g);
  run(false, y2, dx2, g2);
  run(true, y3, dx3, g3);
  const double ey = rel_err(y, y_ref.slice(0, b0, b1)), ex = rel_err(dx, dx_ref.slice(0, b0, b1));
  double eg = 0;
  std::string worst_param;
  bool same = same_bits(y, y2) && same_bits(dx, dx2) && same_bits(y, y3) && same_bits(dx, dx3);
  size_t i = 0;
  for (const auto& [name, p] : part.named_parameters()) {
    Tensor ref = whole.find_parameter(name)->grad.to(hlm::Device::cpu);
    if (name.rfind("experts.", 0) == 0) ref = ref.slice(0, e0, e0 + El).contiguous();
    const double e = rel_err(g[i], ref);
    if (!(e <= tol)) expect(false, "the gradient of " + name, R);
    if (e > eg) eg = e, worst_param = name;
    same = same && same_bits(g[i], g2[i]) && same_bits(g[i], g3[i]);
    ++i;
  }
  expect(ey <= tol, "this rank's output", R);
  expect(ex <= tol, "this rank's input gradient", R);
  expect(same, "the same bits run again and with recompute", R);
  w.barrier();
  std::printf(
      "moe_ep: rank %d of %d (%s %s): experts [%lld, %lld), %lld tokens: y %.2e, dx %.2e, grads "
      "%.2e (%s): %d of %d checks passed\n",
      R, N, dtype.c_str(), device.c_str(), (long long)e0, (long long)(e0 + El),
      (long long)(b1 - b0), ey, ex, eg, worst_param.c_str(), checks - failures, checks);
  return failures == 0 ? 0 : 1;
}

// One context-parallel step of `model` on this rank's slice of (tokens, targets), with the whole
// batch's normalizers: the forward, the indexer losses rescaled by the slice's share of their rows
// (summed over `group`, the ranks that split the batch, as the trainer does), and the backward.
// Returns the loss terms {objective, lm, aux, indexer, mtp}, this slice's shares, and the output.
std::vector<double> cp_step(hlm::HybridModel& model, const hlm::Context& ctx, Comm& group,
                            const hlm::dist::CpSlice& slice, hlm::KdaCpMode mode,
                            const Tensor& tokens, const Tensor& targets, int64_t lm_norm,
                            int64_t mtp_norm, hlm::ModelOutput* out = nullptr) {
  const int64_t b0 = slice.begin(slice.rank()), b1 = slice.end(slice.rank());
  hlm::ModelInputs in;
  in.tokens = tokens.slice(0, b0, b1).contiguous();
  in.targets = targets.slice(0, b0, b1).contiguous();
  in.lm_normalizer = lm_norm;
  in.mtp_normalizer = mtp_norm;
  in.aux_sequences = slice.global().num_seqs();
  in.cp = &slice;
  in.cp_mode = mode;
  hlm::HybridModel::SavedPtr s;
  hlm::ModelOutput o = model.forward(ctx, in, &s);
  Tensor rows = Tensor::from_vector<int64_t>({int64_t(o.indexer_rows.size())}, o.indexer_rows);
  if (rows.numel() > 0) group.allreduce_sum(rows);
  const std::vector<int64_t> all = rows.to_i64_vector();
  std::vector<double> scales;
  double indexer = 0;
  for (size_t i = 0; i < o.indexer_rows.size(); ++i) {
    scales.push_back(all[i] > 0 ? double(o.indexer_rows[i]) / double(all[i]) : 0.0);
    indexer += o.indexer_losses[i] * scales.back();
  }
  model.backward(ctx, *s, {}, scales);
  const std::vector<double> l{o.loss - o.indexer_loss + indexer, o.lm_loss, o.aux_loss, indexer,
                              o.mtp_loss};
  if (out) *out = std::move(o);
  return l;
}

// `--model-cp DTYPE DEVICE [short]` (f64 or f32; cpu or cuda): the whole model's context
// parallelism (ModelInputs::cp) over this job's ranks against the whole batch run in this process:
// a model of three KDA layers (4 heads of 32), a dense MLP and MoE layers with the aux loss, and
// mHC, a fourth layer, DSA with the KPool indexer (top-16 of pools of 4 with the tail) and its
// loss, in the sparse stage and the dense warm-up, and the MTP block (a DSA layer and a MoE; the
// last position of a slice whose sequence goes on takes the next rank's first token). Each rank
// runs its slice with the whole batch's normalizers, and rescales its indexer losses (and their
// gradients) by its share of the rows, as the trainer does; the loss terms summed over the ranks,
// every parameter gradient summed over the ranks and the expert counts summed over the ranks must
// equal the whole batch's: within 1e-10 (f64) or 5e-5 (f32) relative (the counts exactly),
// chunkwise and (when the group's size divides the 4 heads) headwise, without recompute, with
// selective and with full recompute, and the same bits when run again. Batches: sequences cut by
// the slice bounds (one of 300 tokens; 70, 3 and 100 with a one-token slice at 3 and 4 ranks).
// `short` runs the first batch without recompute only (the emulated GPU's run).
int model_cp(const std::string& dtype, const std::string& device, bool all_cases) {
  const auto [dt, dev] = layer_check_args("--model-cp", dtype, device);
  const double tol = dt == DType::f64 ? 1e-10 : 5e-5;
  Comm& w = hlm::dist::world();
  const int R = w.rank(), N = w.size();
  nlohmann::json cfg = nlohmann::json::parse(R"({
    "model_type": "glm5_next_text", "vocab_size": 24, "hidden_size": 16,
    "num_hidden_layers": 3, "layer_pattern": "KKK", "first_k_dense_replace": 1,
    "intermediate_size": 24, "initializer_range": 0.2,
    "linear_num_heads": 4, "linear_head_dim": 32, "linear_conv_kernel_dim": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "moe_intermediate_size": 8, "router_aux_loss_coef": 0.05, "mhc": true, "hc_mult": 4,
    "num_nextn_predict_layers": 1, "gemm_precision": "native"
  })");
  cfg.update(nlohmann::json::parse(R"({
      "num_hidden_layers": 4, "layer_pattern": "KKDK",
      "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 8, "kv_lora_rank": 8,
      "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4,
      "index_n_heads": 2, "index_head_dim": 8, "index_topk": 16, "index_kpool": 4,
      "index_kpool_always_select_tail": true, "dsa_indexer_loss_coeff": 0.5
    })"));
  const hlm::ModelConfig mc = hlm::ModelConfig::from_json(cfg);
  struct Case {
    const char* name;
    std::vector<int64_t> lengths, bounds;
  };
  std::vector<Case> cases = {{"one sequence, even split", {300}, {}}};
  if (all_cases && N == 3) cases.push_back({"a one-token slice", {70, 3, 100}, {0, 71, 72, 173}});
  if (all_cases && N == 4)
    cases.push_back({"a one-token slice", {70, 3, 100}, {0, 71, 72, 130, 173}});
  if (all_cases && N == 2) cases.push_back({"three sequences", {70, 3, 100}, {}});
  std::vector<hlm::KdaCpMode> modes{hlm::KdaCpMode::chunkwise};
  if (4 % N == 0) modes.push_back(hlm::KdaCpMode::headwise);
  std::vector<hlm::Recompute> recomputes{hlm::Recompute::none};
  if (all_cases)
    recomputes = {hlm::Recompute::none, hlm::Recompute::selective, hlm::Recompute::full};
  std::vector<hlm::DsaStage> stages{hlm::DsaStage::sparse};
  if (all_cases) stages.push_back(hlm::DsaStage::dense_warmup);
  double worst = 0;
  for (const hlm::Recompute rc : recomputes)
    for (const hlm::DsaStage stage : stages) {
      hlm::HybridModelOptions mo;
      mo.dtype = dt;
      mo.seed = 2026;
      mo.recompute = rc;
      hlm::HybridModel model(mc, mo);
      model.to(dev);
      model.set_dsa_stage(stage);
      const auto params = model.named_parameters();
      for (const Case& k : cases) {
        const hlm::SeqLayout seqs = hlm::SeqLayout::from_lengths(k.lengths);
        const int64_t T = seqs.total_tokens();
        hlm::Rng rng(7, uint64_t(T));
        const auto [tokens, targets] = random_tokens(T, 24, rng);
        const std::vector<int64_t> tgt = targets.to_i64_vector();
        const hlm::Context ctx{true, false};
        // The whole batch here.
        model.zero_grad();
        hlm::ModelInputs whole;
        whole.tokens = tokens;
        whole.cu_seqlens =
            Tensor::from_vector<int64_t>({int64_t(seqs.offsets().size())}, seqs.offsets());
        whole.targets = targets;
        hlm::HybridModel::SavedPtr sw;
        const hlm::ModelOutput ow = model.forward(ctx, whole, &sw);
        model.backward(ctx, *sw);
        sw.reset();
        std::vector<Tensor> g_ref;
        for (const auto& [name, p] : params) g_ref.push_back(p->grad.to(hlm::Device::cpu));
        const std::vector<double> l_ref{ow.loss, ow.lm_loss, ow.aux_loss, ow.indexer_loss,
                                        ow.mtp_loss};
        expect(ow.mtp_loss > 0, std::string(k.name) + ": an MTP loss", R);
        expect(ow.indexer_loss > 0, std::string(k.name) + ": an indexer loss", R);
        // This rank's slice.
        const std::vector<int64_t> bounds =
            k.bounds.empty() ? hlm::dist::CpSlice::even_bounds(T, N) : k.bounds;
        const hlm::dist::CpSlice slice(w, seqs, bounds);
        int64_t lm_norm = 0;
        for (int64_t v : tgt) lm_norm += v != -100;
        for (const hlm::KdaCpMode mode : modes) {
          const std::string what =
              std::string(k.name) + ", " +
              (mode == hlm::KdaCpMode::headwise ? "headwise" : "chunkwise") + ", recompute " +
              hlm::recompute_name(rc) +
              (stage == hlm::DsaStage::sparse ? ", DSA sparse" : ", DSA dense warm-up");
          auto run = [&](std::vector<double>& l, std::vector<Tensor>& g, std::vector<Tensor>& c) {
            model.zero_grad();
            hlm::ModelOutput o;
            Tensor lt = Tensor::from_vector<double>(
                {5},
                cp_step(model, ctx, w, slice, mode, tokens, targets, lm_norm, ow.mtp_count, &o));
            w.allreduce_sum(lt);
            l = lt.to_f64_vector();
            g.clear();
            for (const auto& [name, p] : params) {
              Tensor h = p->grad.to(hlm::Device::cpu).contiguous();
              w.allreduce_sum(h);
              g.push_back(h);
            }
            c.clear();
            for (const Tensor& ct : o.expert_counts) {
              Tensor h = ct.to(hlm::Device::cpu).contiguous();
              w.allreduce_sum(h);
              c.push_back(h);
            }
          };
          std::vector<double> l, l2;
          std::vector<Tensor> g, g2, c, c2;
          run(l, g, c);
          run(l2, g2, c2);
          double el = 0, eg = 0;
          std::string worst_param;
          bool same = l == l2;
          for (size_t i = 0; i < l_ref.size(); ++i)
            el = std::max(el, std::abs(l[i] - l_ref[i]) / std::max(std::abs(l_ref[i]), 1e-30));
          for (size_t i = 0; i < params.size(); ++i) {
            const double e = rel_err(g[i], g_ref[i]);
            if (!(e <= tol)) expect(false, what + ": gradient of " + params[i].first, R);
            if (e > eg) eg = e, worst_param = params[i].first;
            same = same && same_bits(g[i], g2[i]);
          }
          bool counts = c.size() == ow.expert_counts.size();
          for (size_t i = 0; counts && i < c.size(); ++i)
            counts = same_bits(c[i], ow.expert_counts[i].to(hlm::Device::cpu).contiguous());
          expect(el <= tol, what + ": the loss terms", R);
          expect(counts, what + ": the expert counts", R);
          expect(same, what + ": the same bits run again", R);
          if (R == 0)
            std::printf("model_cp: %d ranks (%s %s): %s: losses %.2e (aux %.6g), grads %.2e (%s)\n",
                        N, dtype.c_str(), device.c_str(), what.c_str(), el, l[2], eg,
                        worst_param.c_str());
          worst = std::max({worst, el, eg});
        }
      }
    }
  w.barrier();
  std::printf("model_cp: rank %d of %d: worst %.2e (tolerance %.0e): %d of %d checks passed\n", R,
              N, worst, tol, checks - failures, checks);
  return failures == 0 ? 0 : 1;
}

// One layer's run for --tp: the output, the input gradient and the indexer loss (DSA).
struct TpRun {
  Tensor y, dx;
  double loss = 0;
};
using TpRunFn = std::function<TpRun(hlm::Module&, const hlm::Context&)>;

// This rank's part of `whole` (loaded from it) against the whole layer, both run here on the same
// x and dy (fn): the parts' outputs and input gradients summed over the job's ranks, each
// parameter's gradient (sliced: this rank's slice of the whole's; replicated: summed over the
// ranks; identical: this rank's own) and the loss, within tol of the whole layer's (max error
// over max value); the same bits run again and under selective recompute. Returns the worst.
double check_tp_layer(const std::string& what, hlm::Module& whole, hlm::Module& part,
                      const std::vector<hlm::TpParam>& layouts, const TpRunFn& fn, double tol) {
  Comm& w = hlm::dist::world();
  const int R = w.rank(), N = w.size();
  hlm::tp_load_shard(whole, part, layouts, R, N);
  const hlm::Context plain{true, false};
  whole.zero_grad();
  const TpRun ref = fn(whole, plain);
  auto run = [&](bool recompute, TpRun& out, std::vector<Tensor>& g) {
    part.zero_grad();
    const TpRun r = fn(part, hlm::Context{true, recompute});
    out.y = hlm::dist::allreduce_from(w, r.y).to(hlm::Device::cpu);
    out.dx = hlm::dist::allreduce_from(w, r.dx).to(hlm::Device::cpu);
    out.loss = r.loss;
    hlm::tp_reduce_grads(w, part, layouts);
    g.clear();
    for (const hlm::TpParam& p : layouts)
      g.push_back(part.find_parameter(p.name)->grad.to(hlm::Device::cpu));
  };
  TpRun a, b, c;
  std::vector<Tensor> ga, gb, gc;
  run(false, a, ga);
  run(false, b, gb);
  run(true, c, gc);
  const double ey = rel_err(a.y, ref.y), ex = rel_err(a.dx, ref.dx);
  const double el = std::abs(a.loss - ref.loss) / std::max(std::abs(ref.loss), 1e-30);
  bool same = same_bits(a.y, b.y) && same_bits(a.dx, b.dx) && same_bits(a.y, c.y) &&
              same_bits(a.dx, c.dx) && a.loss == b.loss && a.loss == c.loss;
  double eg = 0;
  std::string worst_param;
  for (size_t i = 0; i < layouts.size(); ++i) {
    const hlm::TpParam& p = layouts[i];
    const Tensor g_ref = hlm::tp_shard(whole.find_parameter(p.name)->grad, p, R, N);
    const double e = rel_err(ga[i], g_ref);
    if (!(e <= tol)) expect(false, what + ": the gradient of " + p.name, R);
    if (e > eg) eg = e, worst_param = p.name;
    same = same && same_bits(ga[i], gb[i]) && same_bits(ga[i], gc[i]);
  }
  expect(ey <= tol, what + ": the output", R);
  expect(ex <= tol, what + ": the input gradient", R);
  expect(el <= tol, what + ": the indexer loss", R);
  expect(same, what + ": the same bits run again and with recompute", R);
  std::printf("tp: rank %d of %d: %s: y %.2e, dx %.2e, loss %.2e, grads %.2e (%s)\n", R, N,
              what.c_str(), ey, ex, el, eg, worst_param.c_str());
  return std::max({ey, ex, el, eg});
}

// `--tp DTYPE DEVICE` (f64 or f32; cpu or cuda): tensor parallelism (layers/tensor_parallel.h)
// over this job's ranks, each rank's part of a layer against the whole layer run in this process
// (check_tp_layer; within 1e-10 for f64, 5e-5 for f32): a KDA layer (4 heads, 8 value heads,
// low-rank gates), the SwiGLU MLP, and DSA layers (4 MLA heads; the indexer with KPool and its
// loss, sparse and dense warm-up), on a packed batch of three sequences
// (tests/dist/tensor_parallel_test.cpp).
int tp(const std::string& dtype, const std::string& device) {
  const auto [dt, dev] = layer_check_args("--tp", dtype, device);
  const double tol = dt == DType::f64 ? 1e-10 : 5e-5;
  Comm& w = hlm::dist::world();
  const int R = w.rank(), N = w.size();
  hlm::PrecisionPolicy policy;  // GEMMs in the dtype (not rounded to bf16)
  policy.default_kind = hlm::GemmKind::native;
  const hlm::SeqLayout seqs = hlm::SeqLayout::from_lengths({40, 3, 57});
  const int64_t T = seqs.total_tokens();
  hlm::Rng rng(2026, 12);
  double worst = 0;
  {
    hlm::KdaConfig c;
    c.hidden_size = 48;
    c.num_heads = 4;
    c.num_v_heads = 8;
    c.head_k_dim = c.head_v_dim = 32;
    c.decay_rank = c.output_gate_rank = 8;
    hlm::KdaLayer whole(c, policy, "kda", dt);
    whole.init_weights(rng.next_u64());
    rng.fill_uniform(whole.A_log().value, -0.5, 1.0);
    rng.fill_uniform(whole.dt_bias().value, -1.0, 1.0);
    rng.fill_uniform(whole.o_norm_weight().value, 0.5, 1.5);
    hlm::KdaLayer part(hlm::kda_tp_config(c, N), policy, "kda", dt);
    whole.to(dev);
    part.to(dev);
    const Tensor x = random_rows(T, c.hidden_size, dt, dev, rng);
    const Tensor dy = random_rows(T, c.hidden_size, dt, dev, rng);
    const TpRunFn fn = [&](hlm::Module& m, const hlm::Context& ctx) {
      auto& l = dynamic_cast<hlm::KdaLayer&>(m);
      hlm::KdaLayer::Saved s;
      TpRun r;
      r.y = l.forward(ctx, x, seqs, nullptr, &s);
      r.dx = l.backward(ctx, dy, s).dx;
      return r;
    };
    worst = std::max(worst, check_tp_layer("KDA", whole, part, hlm::kda_tp_params(c), fn, tol));
  }
  {
    hlm::DenseMlpConfig c;
    c.hidden_size = 48;
    c.intermediate_size = 64;
    c.dtype = dt;
    c.seed = 9;
    c.init_std = 0.2;
    hlm::DenseMlp whole(c, policy, "mlp");
    hlm::DenseMlp part(hlm::mlp_tp_config(c, N), policy, "mlp");
    whole.to(dev);
    part.to(dev);
    const Tensor x = random_rows(T, c.hidden_size, dt, dev, rng);
    const Tensor dy = random_rows(T, c.hidden_size, dt, dev, rng);
    const TpRunFn fn = [&](hlm::Module& m, const hlm::Context& ctx) {
      auto& l = dynamic_cast<hlm::DenseMlp&>(m);
      hlm::DenseMlp::Saved s;
      TpRun r;
      r.y = l.forward(ctx, x, &s);
      r.dx = l.backward(ctx, dy, s);
      return r;
    };
    worst = std::max(worst, check_tp_layer("MLP", whole, part, hlm::mlp_tp_params(c), fn, tol));
  }
  for (const hlm::DsaStage stage : {hlm::DsaStage::sparse, hlm::DsaStage::dense_warmup}) {
    hlm::DsaLayerConfig c;
    c.mla.hidden_size = 32;
    c.mla.num_heads = 4;
    c.mla.q_lora_rank = 16;
    c.mla.kv_lora_rank = 16;
    c.mla.qk_nope_head_dim = 8;
    c.mla.v_head_dim = 8;
    c.mla.param_dtype = dt;
    c.mla.init_std = 0.2;
    hlm::IndexerConfig ic;
    ic.hidden_size = 32;
    ic.q_lora_rank = 16;
    ic.n_heads = 2;
    ic.head_dim = 8;
    ic.topk = 12;
    ic.kpool = 4;
    ic.dtype = dt;
    ic.seed = 5;
    c.indexer = ic;
    c.stage = stage;
    c.indexer_loss_coeff = 0.5;
    hlm::DsaLayer whole(c, policy, "attn");
    whole.init_weights(rng.next_u64());
    hlm::DsaLayer part(hlm::dsa_tp_config(c, N), policy, "attn");
    part.set_tensor_parallel(&w);
    whole.to(dev);
    part.to(dev);
    const Tensor x = random_rows(T, c.mla.hidden_size, dt, dev, rng);
    const Tensor dy = random_rows(T, c.mla.hidden_size, dt, dev, rng);
    const TpRunFn fn = [&](hlm::Module& m, const hlm::Context& ctx) {
      auto& l = dynamic_cast<hlm::DsaLayer&>(m);
      hlm::DsaLayer::Saved s;
      TpRun r;
      const hlm::DsaLayer::Output o = l.forward(ctx, x, seqs, &s);
      r.y = o.y;
      r.loss = o.indexer_loss;
      r.dx = l.backward(ctx, dy, s);
      return r;
    };
    const char* name =
        stage == hlm::DsaStage::sparse ? "DSA, KPool, sparse" : "DSA, KPool, dense warm-up";
    worst = std::max(worst, check_tp_layer(name, whole, part, hlm::dsa_tp_params(whole), fn, tol));
  }
  w.barrier();
  std::printf("tp: rank %d of %d (%s %s): worst %.2e (tolerance %.0e): %d of %d checks passed\n", R,
              N, dtype.c_str(), device.c_str(), worst, tol, checks - failures, checks);
  return failures == 0 ? 0 : 1;
}

// The model of --model-tp and --model-tpcp: KDA (4 heads), DSA (4 MLA heads, the KPool indexer
// and its loss), a dense MLP, MoE with the aux loss, mHC and the MTP block.
hlm::ModelConfig tp_check_model() {
  return hlm::ModelConfig::from_json(nlohmann::json::parse(R"({
    "model_type": "glm5_next_text", "vocab_size": 24, "hidden_size": 16,
    "num_hidden_layers": 3, "layer_pattern": "KDK", "first_k_dense_replace": 1,
    "intermediate_size": 24, "initializer_range": 0.2,
    "linear_num_heads": 4, "linear_head_dim": 32, "linear_conv_kernel_dim": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 8, "kv_lora_rank": 8,
    "qk_nope_head_dim": 4, "qk_rope_head_dim": 0, "v_head_dim": 4,
    "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4, "index_kpool": 2,
    "dsa_indexer_loss_coeff": 0.3,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "moe_intermediate_size": 8, "router_aux_loss_coef": 0.05, "mhc": true, "hc_mult": 4,
    "num_nextn_predict_layers": 1, "gemm_precision": "native"
  })"));
}

// `--model-tp DTYPE DEVICE` (f64 or f32; cpu or cuda): the whole model's tensor parallelism
// (HybridModelOptions::tensor_comm) over this job's ranks against the whole model run in this
// process (the same seed): KDA and DSA layers (4 heads each; KPool and the indexer loss), a
// dense MLP and MoE layers with the aux loss, mHC and the MTP block. Each rank's parameters must
// be its parts of the whole model's, bit for bit; the loss terms (the same bits on every rank)
// and every parameter gradient (tp_reduce_grads, then this rank's part of the whole's) within
// 1e-10 (f64) or 5e-5 (f32) relative, without recompute and with full recompute (the same bits
// as without), and the same bits run again.
int model_tp(const std::string& dtype, const std::string& device) {
  const auto [dt, dev] = layer_check_args("--model-tp", dtype, device);
  const double tol = dt == DType::f64 ? 1e-10 : 5e-5;
  Comm& w = hlm::dist::world();
  const int R = w.rank(), N = w.size();
  const hlm::ModelConfig mc = tp_check_model();
  const hlm::SeqLayout seqs = hlm::SeqLayout::from_lengths({37, 20});
  const int64_t T = seqs.total_tokens();
  hlm::Rng rng(8, 3);
  hlm::ModelInputs in;
  std::tie(in.tokens, in.targets) = random_tokens(T, 24, rng);
  in.cu_seqlens = Tensor::from_vector<int64_t>({int64_t(seqs.offsets().size())}, seqs.offsets());
  const hlm::Context ctx{true, false};
  auto loss_terms = [](const hlm::ModelOutput& o) {
    return std::vector<double>{o.loss, o.lm_loss, o.mtp_loss, o.aux_loss, o.indexer_loss};
  };
  hlm::HybridModelOptions mo;
  mo.dtype = dt;
  mo.seed = 2026;
  // The whole model here.
  hlm::HybridModel whole(mc, mo);
  whole.to(dev);
  whole.zero_grad();
  hlm::HybridModel::SavedPtr sw;
  const std::vector<double> l_ref = loss_terms(whole.forward(ctx, in, &sw));
  whole.backward(ctx, *sw);
  sw.reset();
  // On GPUs the group's sums run over NCCL (the emulation's stand-in in CI) when the build has
  // it, else through the host.
  std::unique_ptr<Comm> nccl;
  if (dev != hlm::Device::cpu && hlm::dist::have_nccl()) nccl = hlm::dist::nccl_comm(w);
  Comm* tp_comm = nccl ? nccl.get() : &w;
  double worst = 0;
  std::vector<Tensor> g_first;
  for (const hlm::Recompute rc : {hlm::Recompute::none, hlm::Recompute::full}) {
    const std::string what = std::string("recompute ") + hlm::recompute_name(rc);
    hlm::HybridModelOptions po = mo;
    po.recompute = rc;
    po.tensor_comm = tp_comm;
    hlm::HybridModel part(mc, po);
    const std::vector<hlm::TpParam> layouts = part.tensor_parallel_params();
    bool init = layouts.size() == part.named_parameters().size();
    for (const hlm::TpParam& p : layouts)
      init = init && same_bits(part.find_parameter(p.name)->value,
                               hlm::tp_shard(whole.find_parameter(p.name)->value, p, R, N));
    expect(init, what + ": this rank's parameters are its parts of the whole model's", R);
    part.to(dev);
    auto run = [&](std::vector<double>& l, std::vector<Tensor>& g) {
      part.zero_grad();
      hlm::HybridModel::SavedPtr s;
      l = loss_terms(part.forward(ctx, in, &s));
      part.backward(ctx, *s);
      hlm::tp_reduce_grads(*tp_comm, part, layouts);
      g.clear();
      for (const hlm::TpParam& p : layouts)
        g.push_back(part.find_parameter(p.name)->grad.to(hlm::Device::cpu));
    };
    std::vector<double> l, l2;
    std::vector<Tensor> g, g2;
    run(l, g);
    run(l2, g2);
    double el = 0, eg = 0;
    std::string worst_param;
    bool same = l == l2;
    for (size_t i = 0; i < l.size(); ++i)
      el = std::max(el, std::abs(l[i] - l_ref[i]) / std::max(std::abs(l_ref[i]), 1e-30));
    // The loss terms are the same bits on every rank.
    const Tensor all = w.allgather(Tensor::from_vector<double>({1, int64_t(l.size())}, l));
    bool everywhere = true;
    for (int r = 0; r < N; ++r)
      for (size_t i = 0; i < l.size(); ++i)
        everywhere = everywhere && all.data<double>()[r * int64_t(l.size()) + int64_t(i)] == l[i];
    for (size_t i = 0; i < layouts.size(); ++i) {
      const hlm::TpParam& p = layouts[i];
      const Tensor ref = hlm::tp_shard(whole.find_parameter(p.name)->grad, p, R, N);
      const double e = rel_err(g[i], ref);
      if (!(e <= tol)) expect(false, what + ": the gradient of " + p.name, R);
      if (e > eg) eg = e, worst_param = p.name;
      same = same && same_bits(g[i], g2[i]);
      if (!g_first.empty()) same = same && same_bits(g[i], g_first[i]);
    }
    if (g_first.empty()) g_first = g;
    expect(l_ref[4] > 0 && l_ref[3] > 0, what + ": the indexer and aux losses are on", R);
    expect(el <= tol, what + ": the loss terms", R);
    expect(everywhere, what + ": the loss terms are the same on every rank", R);
    expect(same, what + ": the same bits run again (and as without recompute)", R);
    if (R == 0)
      std::printf(
          "model_tp: %d ranks (%s %s, %s): %s: losses %.2e (indexer %.6g, aux %.6g), grads "
          "%.2e (%s)\n",
          N, dtype.c_str(), device.c_str(), tp_comm->backend(), what.c_str(), el, l[4], l[3], eg,
          worst_param.c_str());
    worst = std::max({worst, el, eg});
  }
  w.barrier();
  std::printf("model_tp: rank %d of %d: worst %.2e (tolerance %.0e): %d of %d checks passed\n", R,
              N, worst, tol, checks - failures, checks);
  return failures == 0 ? 0 : 1;
}

// `--model-tpcp DTYPE DEVICE` (4 ranks): tensor and context parallelism together, the ranks
// tp = 2 x cp = 2 (rank = 2 c + a: the tensor groups are pairs of consecutive ranks, the context
// groups the ranks of one tensor rank, the tensor-context group all four). The model of
// --model-tp (KDA, DSA with KPool and its loss, MoE with the aux loss, mHC, MTP) runs each
// context slice of the batch (37 + 20 tokens: the slice boundary inside the first sequence) on
// each tensor group, with the whole batch's normalizers and the indexer losses rescaled by the
// slice's share of the rows; the loss terms summed over a context group, and every parameter's
// gradient (its tensor part, the replicated parts summed over the tensor group) summed over the
// context group, must equal the whole model's on the whole batch in one process: within 1e-10
// (f64) or 5e-5 (f32), chunkwise and headwise, and the same bits when run again.
int model_tpcp(const std::string& dtype, const std::string& device) {
  const auto [dt, dev] = layer_check_args("--model-tpcp", dtype, device);
  const double tol = dt == DType::f64 ? 1e-10 : 5e-5;
  Comm& w = hlm::dist::world();
  const int R = w.rank(), N = w.size();
  if (N != 4) {
    std::fprintf(stderr, "dist_check: --model-tpcp runs on 4 ranks, got %d\n", N);
    return 2;
  }
  const int tp = 2, a = R % tp;
  const std::unique_ptr<Comm> tp_comm = w.split(R / tp, R), cp_comm = w.split(a, R);
  const hlm::ModelConfig mc = tp_check_model();
  const hlm::SeqLayout seqs = hlm::SeqLayout::from_lengths({37, 20});
  const int64_t T = seqs.total_tokens();
  hlm::Rng rng(8, 4);
  const auto [tokens, targets] = random_tokens(T, 24, rng);
  const hlm::Context ctx{true, false};
  hlm::HybridModelOptions mo;
  mo.dtype = dt;
  mo.seed = 2026;
  // The whole model on the whole batch here.
  hlm::HybridModel whole(mc, mo);
  whole.to(dev);
  whole.zero_grad();
  hlm::ModelInputs all;
  all.tokens = tokens;
  all.targets = targets;
  all.cu_seqlens = Tensor::from_vector<int64_t>({int64_t(seqs.offsets().size())}, seqs.offsets());
  hlm::HybridModel::SavedPtr sw;
  const hlm::ModelOutput ow = whole.forward(ctx, all, &sw);
  whole.backward(ctx, *sw);
  sw.reset();
  const std::vector<double> l_ref{ow.loss, ow.lm_loss, ow.aux_loss, ow.indexer_loss, ow.mtp_loss};
  int64_t lm_norm = 0;
  for (int64_t v : targets.to_i64_vector()) lm_norm += v != -100;
  const hlm::dist::CpSlice slice(*cp_comm, seqs, hlm::dist::CpSlice::even_bounds(T, 2));
  double worst = 0;
  for (const hlm::KdaCpMode mode : {hlm::KdaCpMode::chunkwise, hlm::KdaCpMode::headwise}) {
    const std::string what = mode == hlm::KdaCpMode::headwise ? "headwise" : "chunkwise";
    hlm::HybridModelOptions po = mo;
    po.tensor_comm = tp_comm.get();
    po.tensor_context_comm = &w;
    hlm::HybridModel part(mc, po);
    part.to(dev);
    const std::vector<hlm::TpParam> layouts = part.tensor_parallel_params();
    auto run = [&](std::vector<double>& l, std::vector<Tensor>& g) {
      part.zero_grad();
      // The tensor ranks share their slice: its indexer rows are summed over the context group.
      Tensor lt = Tensor::from_vector<double>(
          {5}, cp_step(part, ctx, *cp_comm, slice, mode, tokens, targets, lm_norm, ow.mtp_count));
      hlm::tp_reduce_grads(*tp_comm, part, layouts);
      cp_comm->allreduce_sum(lt);
      l = lt.to_f64_vector();
      g.clear();
      for (const hlm::TpParam& p : layouts) {
        Tensor h = part.find_parameter(p.name)->grad.to(hlm::Device::cpu).contiguous();
        cp_comm->allreduce_sum(h);
        g.push_back(h);
      }
    };
    std::vector<double> l, l2;
    std::vector<Tensor> g, g2;
    run(l, g);
    run(l2, g2);
    double el = 0, eg = 0;
    std::string worst_param;
    bool same = l == l2;
    for (size_t i = 0; i < l.size(); ++i)
      el = std::max(el, std::abs(l[i] - l_ref[i]) / std::max(std::abs(l_ref[i]), 1e-30));
    for (size_t i = 0; i < layouts.size(); ++i) {
      const hlm::TpParam& p = layouts[i];
      const Tensor ref = hlm::tp_shard(whole.find_parameter(p.name)->grad, p, a, tp);
      const double e = rel_err(g[i], ref);
      if (!(e <= tol)) expect(false, what + ": the gradient of " + p.name, R);
      if (e > eg) eg = e, worst_param = p.name;
      same = same && same_bits(g[i], g2[i]);
    }
    expect(l_ref[2] > 0 && l_ref[3] > 0 && l_ref[4] > 0, what + ": the aux, indexer and MTP losses",
           R);
    expect(el <= tol, what + ": the loss terms", R);
    expect(same, what + ": the same bits run again", R);
    if (R == 0)
      std::printf("model_tpcp: tp 2 x cp 2 (%s %s): %s: losses %.2e, grads %.2e (%s)\n",
                  dtype.c_str(), device.c_str(), what.c_str(), el, eg, worst_param.c_str());
    worst = std::max({worst, el, eg});
  }
  w.barrier();
  std::printf("model_tpcp: rank %d of %d: worst %.2e (tolerance %.0e): %d of %d checks passed\n", R,
              N, worst, tol, checks - failures, checks);
  return failures == 0 ? 0 : 1;
}

// A parallel degree of --train: a whole number >= 1.
int degree(const char* s) {
  char* end = nullptr;
  const long v = std::strtol(s, &end, 10);
  HLM_CHECK(*s != 0 && *end == 0 && v >= 1 && v <= 4096,
            "--train: a parallel degree must be a whole number in [1, 4096], got '{}'", s);
  return int(v);
}

int main(int argc, char** argv) {
  try {
    if (argc >= 5 && argc <= 8 && std::string(argv[1]) == "--train")
      return train(argv[2], argv[3], argv[4], argc >= 6 ? degree(argv[5]) : 1,
                   argc >= 7 ? degree(argv[6]) : 1, argc == 8 ? degree(argv[7]) : 1);
    if ((argc == 4 || (argc == 5 && std::string(argv[4]) == "short")) &&
        std::string(argv[1]) == "--kda-cp")
      return kda_cp(argv[2], argv[3], argc == 4);
    if (argc == 4 && std::string(argv[1]) == "--moe-ep") return moe_ep(argv[2], argv[3]);
    if (argc == 4 && std::string(argv[1]) == "--tp") return tp(argv[2], argv[3]);
    if (argc == 4 && std::string(argv[1]) == "--model-tp") return model_tp(argv[2], argv[3]);
    if (argc == 4 && std::string(argv[1]) == "--model-tpcp") return model_tpcp(argv[2], argv[3]);
    if ((argc == 4 || (argc == 5 && std::string(argv[4]) == "short")) &&
        std::string(argv[1]) == "--model-cp")
      return model_cp(argv[2], argv[3], argc == 4);
    const bool nccl = argc > 1 && std::string(argv[1]) == "--nccl";
    if (nccl) {
      HLM_CHECK(hlm::cuda_device_count() > 0, "--nccl: no CUDA device is present");
      hlm::cuda_select_device(hlm::dist::local_rank() % hlm::cuda_device_count());
    }
    Comm& w = hlm::dist::world();
    const int R = w.rank(), N = w.size();
    if (nccl) check_nccl(w);
    // Sums: sizes that do and do not divide by N, one element, none.
    for (int64_t n : {int64_t(1000), int64_t(1), int64_t(N * 37), int64_t(0)}) {
      check_allreduce<float>(w, n, DType::f32, "f32");
      check_allreduce<double>(w, n, DType::f64, "f64");
      check_allreduce<int64_t>(w, n, DType::i64, "i64");
    }
    // reduce_scatter: rank r's rows of the rank-ordered sum.
    {
      const int64_t m = 5, n = N * m * 3;
      const Tensor t = input<float>(R, n, DType::f32).view({N * m, 3});
      const Tensor mine = w.reduce_scatter_sum(t);
      const std::vector<float> want = ordered_sum<float>(N, n, DType::f32);
      expect(mine.shape() == Shape({m, 3}) &&
                 std::memcmp(mine.raw(), want.data() + R * m * 3, size_t(m * 3) * 4) == 0,
             "reduce_scatter_sum gives this rank's rows of the ordered sum", R);
    }
    // Rows split unevenly over the ranks (odd ranks hold none): gathered whole, and each rank's
    // rows of the rank-ordered sum of every rank's whole tensor.
    {
      std::vector<int64_t> bounds{0};
      for (int r = 0; r < N; ++r) bounds.push_back(bounds.back() + (r % 2 ? 0 : r + 2));
      const int64_t rows = bounds[size_t(R) + 1] - bounds[size_t(R)], Tw = bounds.back();
      const Tensor whole = input<double>(0, Tw * 2, DType::f64).view({Tw, 2});
      const Tensor part = whole.slice(0, bounds[size_t(R)], bounds[size_t(R)] + rows).contiguous();
      expect(same_bits(hlm::dist::allgather_rows(w, part, bounds), whole),
             "allgather_rows gives the whole tensor from uneven parts", R);
      const Tensor mine = hlm::dist::reduce_scatter_rows(
          w, input<double>(R, Tw * 2, DType::f64).view({Tw, 2}), bounds);
      const std::vector<double> want = ordered_sum<double>(N, Tw * 2, DType::f64);
      expect(mine.shape() == Shape({rows, 2}) &&
                 (rows == 0 || std::memcmp(mine.raw(), want.data() + bounds[size_t(R)] * 2,
                                           size_t(rows * 2) * 8) == 0),
             "reduce_scatter_rows gives this rank's rows of the ordered sum", R);
    }
    // allgather and broadcast.
    {
      const Tensor t = input<double>(R, 6, DType::f64).view({2, 3});
      const Tensor all = w.allgather(t);
      bool ok = all.shape() == Shape({2 * N, 3});
      for (int r = 0; r < N && ok; ++r)
        ok =
            std::memcmp(all.data<double>() + r * 6, input<double>(r, 6, DType::f64).raw(), 48) == 0;
      expect(ok, "allgather stacks every rank's rows in rank order", R);
      Tensor b = input<double>(R, 7, DType::f64);
      w.broadcast(b, N - 1);
      expect(std::memcmp(b.raw(), input<double>(N - 1, 7, DType::f64).raw(), 56) == 0,
             "broadcast from the last rank", R);
    }
    // all-to-all: block q from rank s holds 1000 s + q.
    {
      std::vector<int64_t> send(static_cast<size_t>(N) * 4), recv(send.size());
      for (int q = 0; q < N; ++q)
        for (int j = 0; j < 4; ++j) send[size_t(q * 4 + j)] = 1000 * R + q + 100 * j;
      w.alltoall_bytes(send.data(), 4 * sizeof(int64_t), recv.data());
      bool ok = true;
      for (int s = 0; s < N; ++s)
        for (int j = 0; j < 4; ++j) ok = ok && recv[size_t(s * 4 + j)] == 1000 * s + R + 100 * j;
      expect(ok, "alltoall_bytes delivers block r of every rank to rank r", R);
      const Tensor t = w.alltoall(Tensor::from_vector<int64_t>({int64_t(N), 4}, send));
      expect(t.shape() == (hlm::Shape{N, 4}) && t.to_i64_vector() == recv,
             "alltoall of a tensor [N, 4] equals alltoall_bytes", R);
    }
    // all-to-all(v): rank s sends q + s + 1 rows of 3 to rank q (none to itself when s == q ==
    // 1), row j holding 1000 s + 10 q + j.
    {
      auto rows = [](int s, int q) { return s == 1 && q == 1 ? int64_t(0) : int64_t(q + s + 1); };
      std::vector<int64_t> send_rows, recv_rows;
      std::vector<double> v;
      for (int q = 0; q < N; ++q) {
        send_rows.push_back(rows(R, q));
        recv_rows.push_back(rows(q, R));
        for (int64_t j = 0; j < rows(R, q); ++j)
          for (int c = 0; c < 3; ++c) v.push_back(1000.0 * R + 10.0 * q + double(j) + 0.1 * c);
      }
      const Tensor t = Tensor::from_vector<double>({int64_t(v.size()) / 3, 3}, v);
      const Tensor got = w.alltoallv(t, send_rows, recv_rows);
      bool ok = true;
      int64_t at = 0;
      for (int src = 0; src < N; ++src)
        for (int64_t j = 0; j < rows(src, R); ++j, ++at)
          for (int c = 0; c < 3; ++c)
            ok = ok &&
                 got.data<double>()[at * 3 + c] == 1000.0 * src + 10.0 * R + double(j) + 0.1 * c;
      expect(ok && got.size(0) == at, "alltoallv delivers each rank's run of rows", R);
    }
    // A ring of send / recv (even ranks send first: no deadlock at any N).
    if (N > 1) {
      const int next = (R + 1) % N, prev = (R + N - 1) % N;
      int64_t out = 77 * R + 5, in = -1;
      if (R % 2 == 0) {
        w.send_bytes(&out, sizeof(out), next, 3);
        w.recv_bytes(&in, sizeof(in), prev, 3);
      } else {
        w.recv_bytes(&in, sizeof(in), prev, 3);
        w.send_bytes(&out, sizeof(out), next, 3);
      }
      expect(in == 77 * prev + 5, "send / recv around the ring", R);
    }
    // Groups: color = rank % 2 (data-parallel-like groups of the even and the odd ranks).
    {
      std::unique_ptr<Comm> g = w.split(R % 2, R);
      const int G = (N - R % 2 + 1) / 2;
      expect(g->size() == G && g->rank() == R / 2, "split gives groups in rank order", R);
      Tensor t = Tensor::from_vector<double>({1}, {double(R) + 0.25});
      g->allreduce_sum(t);
      double want = 0;
      for (int r = R % 2; r < N; r += 2) want += double(r) + 0.25;
      expect(t.data<double>()[0] == want, "allreduce_sum within a group", R);
    }
    // A mismatch between ranks is an error on every rank (not a hang or garbage).
    if (N > 1) {
      bool threw = false;
      try {
        Tensor t = Tensor::zeros({R == 0 ? int64_t(3) : int64_t(4)}, DType::f32);
        w.allreduce_sum(t);
      } catch (const hlm::Error& e) {
        threw = std::string(e.what()).find("different shape") != std::string::npos;
      }
      expect(threw, "a shape mismatch between ranks is refused on every rank", R);
    }
    w.barrier();
    std::printf("dist_check: rank %d of %d (%s%s): %d of %d checks passed\n", R, N, w.backend(),
                nccl ? " and nccl" : "", checks - failures, checks);
    return failures == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::printf("dist_check: error: %s\n", e.what());
    std::fflush(stdout);
    hlm::dist::end_job_on_error(1);
    return 1;
  }
}
