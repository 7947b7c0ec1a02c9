// Data parallelism (train/data_parallel.h). In this process: shard_batch and global_normalizers on
// MQAR batches. Across processes (`mpirun --oversubscribe -np 2 / 4 hybridlm train`, as a user
// runs it): the losses and weights of N processes equal the one-process run's (FP64: 1e-10; FP32:
// the losses within 1e-6), a rerun gives the same bits, a checkpoint saved by 4 processes resumes
// at 2 and at 1 to the straight run's weights, a killed rank ends the job with the last checkpoint
// intact, and bad requests exit with status 2. The model has every loss term: main and MTP
// cross-entropy, the MoE sequence aux loss and the DSA indexer KL (dense warm-up, then sparse).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <tuple>

#include <nlohmann/json.hpp>

#include "core/device.h"
#include "core/safetensors.h"
#include "dist/comm.h"
#include "dist/nccl_comm.h"
#include "testing.h"
#include "train/data.h"
#include "train/data_parallel.h"

namespace hlm {
namespace {

namespace fs = std::filesystem;

train::Batch mqar_batch(int64_t tokens, int64_t step) {
  train::MqarConfig c;
  c.vocab_size = 64;
  c.num_keys = 32;
  c.tokens_per_step = tokens;
  c.min_pairs = 2;
  c.max_pairs = 6;
  c.seed = testing::test_seed();
  return train::MqarTask(c).batch(step);
}

TEST(DataParallel, PartsAreWholeSequencesThatCoverTheBatch) {
  for (int64_t step : {1, 2, 3}) {
    const train::Batch g = mqar_batch(256, step);
    const std::vector<int64_t> cu = g.cu_seqlens.to_i64_vector(), tok = g.tokens.to_i64_vector(),
                               tgt = g.targets.to_i64_vector();
    const int64_t S = int64_t(cu.size()) - 1, T = cu.back();
    int64_t longest = 0;
    for (int64_t q = 0; q < S; ++q) longest = std::max(longest, cu[size_t(q + 1)] - cu[size_t(q)]);
    for (int n = 1; n <= 4; ++n) {
      SCOPED_TRACE(::testing::Message() << "step " << step << ", " << n << " parts");
      std::vector<int64_t> all_tok, all_tgt, all_cu{0};
      for (int r = 0; r < n; ++r) {
        const train::Batch p = train::shard_batch(g, r, n);
        train::check_batch(p, 64);
        const std::vector<int64_t> pcu = p.cu_seqlens.to_i64_vector();
        ASSERT_GE(pcu.size(), 2u);  // at least one sequence
        // Balanced: no part exceeds an equal share by more than a sequence.
        EXPECT_LE(p.num_tokens(), T / n + longest);
        for (size_t q = 1; q < pcu.size(); ++q)
          all_cu.push_back(all_cu.back() + pcu[q] - pcu[q - 1]);
        for (int64_t v : p.tokens.to_i64_vector()) all_tok.push_back(v);
        for (int64_t v : p.targets.to_i64_vector()) all_tgt.push_back(v);
      }
      EXPECT_EQ(all_cu, cu);
      EXPECT_EQ(all_tok, tok);
      EXPECT_EQ(all_tgt, tgt);
    }
    testing::expect_error([&] { train::shard_batch(g, 0, int(S) + 1); },
                          "needs at least " + std::to_string(S + 1) + " sequences");
  }
}

TEST(DataParallel, NormalizersCountTheWholeBatch) {
  // Two documents: [5 7 9 | 4 6], targets with an ignored position in each.
  train::Batch b;
  b.tokens = Tensor::from_vector<int64_t>({5}, {5, 7, 9, 4, 6});
  b.targets = Tensor::from_vector<int64_t>(
      {5}, {7, train::kIgnoreIndex, train::kIgnoreIndex, 6, train::kIgnoreIndex});
  b.cu_seqlens = Tensor::from_vector<int64_t>({3}, {0, 3, 5});
  const train::LossNormalizers n = train::global_normalizers(b);
  EXPECT_EQ(n.lm, 2);         // positions 0 and 3
  EXPECT_EQ(n.mtp, 0);        // the successors of 0 (1) and of 3 (4) are ignored
  EXPECT_EQ(n.sequences, 2);  // both non-empty
  b.targets = Tensor::from_vector<int64_t>({5}, {7, 9, train::kIgnoreIndex, 6, 1});
  EXPECT_EQ(train::global_normalizers(b).mtp, 2);  // the successors of 0 and of 3
}

// ---- across processes ------------------------------------------------------------------------

// The shared small model (testing::kSmallModelJson) with a KDA layer after its DSA layer and
// nonzero aux and indexer loss coefficients.
std::string model_json() {
  nlohmann::json m = nlohmann::json::parse(testing::kSmallModelJson);
  m["num_hidden_layers"] = 3;
  m["layer_pattern"] = "KDK";
  m["dsa_indexer_loss_coeff"] = 0.1;
  m["router_aux_loss_coef"] = 0.01;
  return m.dump();
}

const char* kTrain = R"({
  "model": "model.json", "steps": 8, "tokens_per_step": 128, "lr": 0.01, "warmup_steps": 2,
  "eval_interval": 0, "eval_batches": 1, "log_interval": 1, "checkpoint_interval": 4,
  "dsa_dense_warmup_steps": 3, "dtype": "f64", "mqar": {"min_pairs": 2, "max_pairs": 4}
})";

class DataParallelRun : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!dist::have_mpi()) GTEST_SKIP() << "this build has no MPI backend";
    bin_ = std::string(HLM_BINARY_DIR) + "/hybridlm";
    if (!fs::exists(bin_)) GTEST_SKIP() << "binary " << bin_ << " not built (ninja hybridlm)";
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / fmt::format("hlm_dp_{}_{}", ::getpid(), info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::ofstream(path("model.json")) << model_json();
    std::ofstream(path("train.json")) << kTrain;
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  std::string path(const std::string& n) const { return (dir_ / n).string(); }
  // `hybridlm train ARGS` in N processes (N = 1: without mpirun); the exit status, output in
  // out.txt / err.txt. `wrap` goes before the binary (e.g. a shell that kills one rank).
  int train(int n, const std::string& args, const std::string& wrap = "") {
    std::string cmd = "cd " + dir_.string() + " && OMP_NUM_THREADS=1 ";
    if (n > 1) cmd += testing::mpirun_prefix(n);
    cmd += wrap + bin_ + " train " + args + " > out.txt 2> err.txt";
    const int st = std::system(cmd.c_str());
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }
  std::string read(const std::string& n) const {
    std::ifstream f(path(n));
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  std::vector<nlohmann::json> metrics(const std::string& run) const {
    std::vector<nlohmann::json> v;
    std::istringstream in(read(run + "/metrics.jsonl"));
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) v.push_back(nlohmann::json::parse(line));
    return v;
  }
  // Every logged loss of `run` against `ref`'s, relative.
  void expect_same_losses(const std::string& run, const std::string& ref, double tol) const {
    const auto a = metrics(run), b = metrics(ref);
    ASSERT_EQ(a.size(), b.size()) << run;
    for (size_t i = 0; i < a.size(); ++i)
      for (const char* k :
           {"loss", "objective", "mtp_loss", "aux_loss", "indexer_loss", "grad_norm"}) {
        const double x = a[i].at(k), y = b[i].at(k);
        EXPECT_LE(std::fabs(x - y), tol * std::fabs(y))
            << run << " step " << a[i].at("step") << " " << k << ": " << x << " vs " << y;
      }
  }
  // Every tensor of `file` in `run` against `ref`'s, relative L2 (0: bit for bit).
  void expect_same_tensors(const std::string& run, const std::string& ref, const char* file,
                           double tol) const {
    const auto a = safetensors::load(path(run + "/" + file));
    const auto b = safetensors::load(path(ref + "/" + file));
    ASSERT_EQ(a.tensors.size(), b.tensors.size()) << run << " " << file;
    for (const auto& [name, t] : a.tensors) {
      ASSERT_TRUE(b.tensors.count(name)) << name;
      const Tensor& u = b.tensors.at(name);
      if (tol == 0)
        EXPECT_TRUE(testing::bit_equal(t, u)) << run << " " << name;
      else
        EXPECT_LE(testing::compare(t, u).rel_l2, tol) << run << " " << name;
    }
  }
  // `run` against the one-process run `ref` (FP64): the losses and weights within 1e-10, the
  // optimizer state (gathered from the shards into the one-process layout) within 1e-9.
  void expect_as_one(const std::string& run, const std::string& ref) const {
    expect_same_losses(run, ref, 1e-10);
    expect_same_tensors(run, ref, "model.safetensors", 1e-10);
    expect_same_tensors(run, ref, "trainer_state.safetensors", 1e-9);
  }
  // Run to run: the same bits.
  void expect_same_bits(const std::string& run, const std::string& ref) const {
    expect_same_tensors(run, ref, "model.safetensors", 0);
    expect_same_tensors(run, ref, "trainer_state.safetensors", 0);
  }
  std::string bin_;
  fs::path dir_;
};

TEST_F(DataParallelRun, TwoAndFourProcessesTrainAsOne) {
  ASSERT_EQ(train(1, "--config train.json --out one"), 0) << read("err.txt");
  // Both stages of the indexer ran, and every loss term is there.
  const auto m = metrics("one");
  ASSERT_EQ(m.size(), 8u);
  for (const char* k : {"mtp_loss", "aux_loss", "indexer_loss"})
    EXPECT_GT(double(m.back().at(k)), 0) << k;
  for (int n : {2, 4}) {
    SCOPED_TRACE(n);
    const std::string run = "n" + std::to_string(n);
    ASSERT_EQ(train(n, "--config train.json --out " + run), 0) << read("err.txt");
    const std::string out = read("out.txt");
    EXPECT_NE(out.find("data parallel: " + std::to_string(n) + " processes (mpi backend)"),
              std::string::npos)
        << out;
    EXPECT_NE(out.find("over " + std::to_string(n) + " data-parallel processes"), std::string::npos)
        << out;
    expect_as_one(run, "one");
  }
  ASSERT_EQ(train(2, "--config train.json --out again"), 0) << read("err.txt");
  expect_same_bits("again", "n2");
  // FP32: every loss term within 1e-5 of the objective (measured: the main loss 1.2e-6 at worst,
  // step 7). FP32 runs whose gradients
  // are summed in different orders drift apart where AdamW normalises gradients near zero to
  // unit steps; FP64 above shows the decomposition itself is exact.
  ASSERT_EQ(train(1, "--config train.json --out f32_one --set dtype=f32"), 0) << read("err.txt");
  ASSERT_EQ(train(2, "--config train.json --out f32_two --set dtype=f32"), 0) << read("err.txt");
  const auto a = metrics("f32_two"), b = metrics("f32_one");
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    for (const char* k : {"loss", "objective", "mtp_loss", "aux_loss", "indexer_loss"})
      EXPECT_LE(std::fabs(double(a[i].at(k)) - double(b[i].at(k))),
                1e-5 * std::fabs(double(b[i].at("objective"))))
          << "step " << i + 1 << " " << k;
}

TEST_F(DataParallelRun, ACheckpointOfFourProcessesResumesAtTwoAndAtOne) {
  ASSERT_EQ(train(1, "--config train.json --out straight"), 0) << read("err.txt");
  ASSERT_EQ(train(4, "--config train.json --out four --stop-after 4"), 0) << read("err.txt");
  fs::copy(dir_ / "four", dir_ / "four_b", fs::copy_options::recursive);
  ASSERT_EQ(train(2, "--resume four"), 0) << read("err.txt");
  EXPECT_NE(read("out.txt").find("resumed from four at step 4"), std::string::npos);
  expect_same_tensors("four", "straight", "model.safetensors", 1e-10);
  ASSERT_EQ(train(1, "--resume four_b"), 0) << read("err.txt");
  expect_same_tensors("four_b", "straight", "model.safetensors", 1e-10);
  expect_same_tensors("four_b", "straight", "trainer_state.safetensors", 1e-9);
}

// Expert parallelism (train/data_parallel.h, ExpertGroups): the experts of both MoE layers and
// the MTP block's split over groups of 2 or 4 processes, data parallel across the groups.
TEST_F(DataParallelRun, ExpertParallelTrainsAsOne) {
  ASSERT_EQ(train(1, "--config train.json --out one"), 0) << read("err.txt");
  for (const auto& [n, ep] : {std::pair{2, 2}, std::pair{4, 2}, std::pair{4, 4}}) {
    SCOPED_TRACE(fmt::format("{} processes, expert parallel {}", n, ep));
    const std::string run = fmt::format("n{}ep{}", n, ep);
    ASSERT_EQ(train(n, fmt::format("--config train.json --out {} --expert-parallel {}", run, ep)),
              0)
        << read("err.txt");
    const std::string out = read("out.txt");
    EXPECT_NE(out.find(fmt::format("expert parallel: {} groups of {} processes, each process "
                                   "holding {} of every MoE layer's 4 experts",
                                   n / ep, ep, 4 / ep)),
              std::string::npos)
        << out;
    // The experts gathered into the one-process layout, weights and optimizer state; the
    // parameter list gives the whole model's shapes.
    expect_as_one(run, "one");
    EXPECT_EQ(read(run + "/parameters.txt"), read("one/parameters.txt")) << run;
  }
  ASSERT_EQ(train(4, "--config train.json --out again --expert-parallel 2"), 0) << read("err.txt");
  expect_same_bits("again", "n4ep2");
  // A checkpoint of 4 processes with the experts split 4 ways resumes at 2 processes split 2
  // ways, and in one process.
  ASSERT_EQ(train(4, "--config train.json --out split --expert-parallel 4 --stop-after 4"), 0)
      << read("err.txt");
  fs::copy(dir_ / "split", dir_ / "split_b", fs::copy_options::recursive);
  ASSERT_EQ(train(2, "--resume split --expert-parallel 2"), 0) << read("err.txt");
  EXPECT_NE(read("out.txt").find("resumed from split at step 4"), std::string::npos);
  expect_as_one("split", "one");
  ASSERT_EQ(train(1, "--resume split_b"), 0) << read("err.txt");
  expect_same_tensors("split_b", "one", "model.safetensors", 1e-10);
}

// Tensor parallelism (HybridModelOptions::tensor_comm): the test model's attention heads and
// dense MLP channels split over groups of 2 processes, alone (2 processes) and data parallel over
// 2 groups (4 processes), each group running its part of the batch (KDA and DSA layers with KPool
// and the indexer loss through both stages, MoE with the aux loss on each process's share of the
// rows, mHC, MTP), with expert parallelism beside it and with context parallelism (2 x 2): the
// one-process run's losses, weights and optimizer state (gathered into the one-process layout), the
// same bits run again, checkpoints resumed across layouts, and the refusals.
TEST_F(DataParallelRun, TensorParallelTrainsAsOne) {
  ASSERT_EQ(train(1, "--config train.json --out one"), 0) << read("err.txt");
  for (const int n : {2, 4}) {
    SCOPED_TRACE(fmt::format("{} processes, tensor parallel 2", n));
    const std::string run = fmt::format("n{}tp2", n);
    ASSERT_EQ(train(n, fmt::format("--config train.json --out {} --tensor-parallel 2", run)), 0)
        << read("err.txt");
    EXPECT_NE(read("out.txt").find(fmt::format("tensor parallel: {} groups of 2 processes (mpi "
                                               "backend), each process holding 1/2 of every "
                                               "attention layer's heads",
                                               n / 2)),
              std::string::npos)
        << read("out.txt");
    expect_as_one(run, "one");
    EXPECT_EQ(read(run + "/parameters.txt"), read("one/parameters.txt"));
  }
  ASSERT_EQ(train(4, "--config train.json --out again --tensor-parallel 2"), 0) << read("err.txt");
  expect_same_bits("again", "n4tp2");
  // With expert parallelism over the data-parallel ranks of each tensor-parallel rank.
  ASSERT_EQ(train(4, "--config train.json --out tpep --tensor-parallel 2 --expert-parallel 2"), 0)
      << read("err.txt");
  EXPECT_NE(read("out.txt").find("expert parallel: 1 groups of 2 processes"), std::string::npos)
      << read("out.txt");
  expect_as_one("tpep", "one");
  // With context parallelism: the tensor groups of one context-parallel pair run the pair's
  // slices of the one part of the batch.
  ASSERT_EQ(train(4, "--config train.json --out tpcp --tensor-parallel 2 --context-parallel 2"), 0)
      << read("err.txt");
  EXPECT_NE(read("out.txt").find("context parallel: 1 groups of 2 processes"), std::string::npos)
      << read("out.txt");
  expect_as_one("tpcp", "one");
  // A checkpoint of 4 processes (2 x 2) resumes at 2 (tensor parallel) and in one process; one
  // process's resumes at 4.
  ASSERT_EQ(train(4, "--config train.json --out split --tensor-parallel 2 --stop-after 4"), 0)
      << read("err.txt");
  fs::copy(dir_ / "split", dir_ / "split_b", fs::copy_options::recursive);
  ASSERT_EQ(train(2, "--resume split --tensor-parallel 2"), 0) << read("err.txt");
  EXPECT_NE(read("out.txt").find("resumed from split at step 4"), std::string::npos);
  expect_as_one("split", "one");
  ASSERT_EQ(train(1, "--resume split_b"), 0) << read("err.txt");
  expect_same_tensors("split_b", "one", "model.safetensors", 1e-10);
  ASSERT_EQ(train(1, "--config train.json --out whole --stop-after 4"), 0) << read("err.txt");
  ASSERT_EQ(train(4, "--resume whole --tensor-parallel 2"), 0) << read("err.txt");
  expect_as_one("whole", "one");
  // Refused, nothing written: a degree that does not divide the processes or the heads, expert
  // groups that do not divide the data-parallel ranks, with context parallelism a product that
  // does not divide the processes and headwise over fewer heads per rank than the degree.
  for (const auto& [n, args, msg] :
       std::initializer_list<std::tuple<int, const char*, const char*>>{
           {3, "--tensor-parallel 2", "the degree must divide the number of processes, 3"},
           {4, "--tensor-parallel 4", "the KDA layers' 2 heads do not divide by the degree"},
           {2, "--tensor-parallel 2 --expert-parallel 2",
            "the expert groups are made of the 1 data-parallel groups' ranks"},
           {2, "--tensor-parallel 2 --context-parallel 2",
            "their product must divide the number of processes, 2"},
           {4, "--tensor-parallel 2 --context-parallel 2 --cp-mode headwise",
            "each rank's 1 KDA heads do not divide by the context-parallel degree 2"}}) {
    SCOPED_TRACE(args);
    EXPECT_EQ(train(n, fmt::format("--config train.json --out refused {}", args)), 2);
    EXPECT_NE(read("err.txt").find(msg), std::string::npos) << read("err.txt");
    EXPECT_FALSE(fs::exists(dir_ / "refused" / "trainer_state.safetensors"));
  }
}

// Context parallelism (HybridModel's ModelInputs::cp): each part of the global batch split along
// its tokens over groups of 2 or 4 processes, the KDA layers chunkwise or headwise; with data
// parallelism across the groups and with expert parallelism; a checkpoint of a context-parallel
// run resumes in one process. The model: the test model's layers all KDA without MTP, with MoE
// and the sequence aux loss; then the whole test model, its DSA layer with the KPool indexer and
// its loss and its MTP block, over 2 and 4 processes.
TEST_F(DataParallelRun, ContextParallelTrainsAsOne) {
  const std::string kda = " --set model.layer_pattern=KKK --set mtp=false";
  ASSERT_EQ(train(1, "--config train.json --out one" + kda), 0) << read("err.txt");
  EXPECT_GT(double(metrics("one").back().at("aux_loss")), 0);
  const std::tuple<int, std::string, std::string> runs[] = {
      {2, "--context-parallel 2", "1 groups of 2 processes"},
      {2, "--context-parallel 2 --cp-mode headwise", "(KDA layers headwise)"},
      {4, "--context-parallel 2", "2 groups of 2 processes"},
      {4, "--context-parallel 4", "1 groups of 4 processes"},
      {4, "--context-parallel 2 --expert-parallel 2", "2 groups of 2 processes"}};
  int i = 0;
  for (const auto& [n, args, says] : runs) {
    SCOPED_TRACE(fmt::format("{} processes, {}", n, args));
    const std::string run = fmt::format("cp{}", i++);
    ASSERT_EQ(train(n, "--config train.json --out " + run + kda + " " + args), 0)
        << read("err.txt");
    EXPECT_NE(read("out.txt").find("context parallel: "), std::string::npos) << read("out.txt");
    EXPECT_NE(read("out.txt").find(says), std::string::npos) << read("out.txt");
    expect_as_one(run, "one");
  }
  ASSERT_EQ(train(4, "--config train.json --out again --context-parallel 2" + kda), 0)
      << read("err.txt");
  expect_same_bits("again", "cp2");
  // A checkpoint of 4 processes in context-parallel pairs resumes in one process.
  ASSERT_EQ(train(4, "--config train.json --out half --context-parallel 2 --stop-after 4" + kda), 0)
      << read("err.txt");
  ASSERT_EQ(train(1, "--resume half"), 0) << read("err.txt");
  expect_same_tensors("half", "one", "model.safetensors", 1e-10);
  // The whole test model: the DSA layer's latent rows and indexer keys gathered over the group,
  // the MTP block's last positions taking the next rank's first token.
  ASSERT_EQ(train(1, "--config train.json --out onedsa"), 0) << read("err.txt");
  EXPECT_GT(double(metrics("onedsa").back().at("indexer_loss")), 0);
  EXPECT_GT(double(metrics("onedsa").back().at("mtp_loss")), 0);
  for (const int n : {2, 4}) {
    SCOPED_TRACE(fmt::format("DSA, {} processes in one context-parallel group", n));
    const std::string run = fmt::format("cpdsa{}", n);
    ASSERT_EQ(train(n, fmt::format("--config train.json --out {} --context-parallel {}", run, n)),
              0)
        << read("err.txt");
    expect_as_one(run, "onedsa");
  }
  // Refused, with nothing written: a degree that does not divide the processes, headwise over
  // more ranks than KDA heads.
  const std::pair<std::string, std::string> bad[] = {
      {"--context-parallel 3" + kda,
       "the degree must be at least 1 and divide the number of processes, 4"},
      {"--context-parallel 4 --cp-mode headwise" + kda,
       "the KDA layers' 2 heads do not divide by the degree 4"},
      {"--context-parallel 2 --cp-mode sideways" + kda, "--cp-mode"}};
  for (const auto& [args, message] : bad) {
    EXPECT_EQ(train(4, "--config train.json --out cpbad " + args), 2) << args;
    EXPECT_NE(read("err.txt").find(message), std::string::npos) << args << ": " << read("err.txt");
    EXPECT_FALSE(fs::exists(dir_ / "cpbad")) << args;
  }
}

TEST_F(DataParallelRun, AKilledRankEndsTheJobAndTheCheckpointResumes) {
  // Rank 1 is killed a moment after the start of a long run that checkpoints every 2 steps.
  const std::string kill1 =
      "sh -c 'if [ \"$OMPI_COMM_WORLD_RANK\" = 1 ]; then (sleep 6; kill -9 $$) & fi; exec \"$0\" "
      "\"$@\"' ";
  const int rc = train(2,
                       "--config train.json --out killed --steps 100000 --set "
                       "checkpoint_interval=2",
                       kill1);
  EXPECT_NE(rc, 0);
  EXPECT_NE(rc, 124) << "the job hung after a rank died";
  const std::string err = read("err.txt");
  EXPECT_NE(err.find("signal 9"), std::string::npos) << err;
  // The last checkpoint is whole: a single process resumes it.
  ASSERT_TRUE(fs::exists(dir_ / "killed" / "trainer_state.safetensors")) << err;
  const auto ck = safetensors::load(path("killed/trainer_state.safetensors"));
  const int64_t at = std::stoll(ck.metadata.at("step"));
  EXPECT_GE(at, 2);
  EXPECT_EQ(at % 2, 0);
  ASSERT_EQ(train(1, "--resume killed --stop-after " + std::to_string(at + 1)), 0)
      << read("err.txt");
  EXPECT_NE(read("out.txt").find("resumed from killed at step " + std::to_string(at)),
            std::string::npos);
}

TEST_F(DataParallelRun, BadRequestsExitWithStatus2) {
  // Fewer sequences per step than processes.
  EXPECT_EQ(train(4, "--config train.json --out few --set tokens_per_step=16"), 2);
  EXPECT_NE(read("err.txt").find("needs at least 4 sequences per step"), std::string::npos)
      << read("err.txt");
  EXPECT_FALSE(fs::exists(dir_ / "few"));
  // Several processes on GPUs without NCCL in the build, or without a GPU: refused before anything
  // is written.
  if (!dist::have_nccl() || !cuda_available()) {
    EXPECT_EQ(train(2, "--config train.json --out gpu --device cuda"), 2);
    EXPECT_NE(read("err.txt").find(dist::have_nccl() ? "no CUDA device is present"
                                                     : "needs the NCCL backend"),
              std::string::npos)
        << read("err.txt");
    EXPECT_FALSE(fs::exists(dir_ / "gpu"));
  }
  // Expert parallelism whose degree does not divide the processes or the experts, or over a
  // model without MoE layers.
  const std::pair<std::string, std::string> bad_ep[] = {
      {"--expert-parallel 3",
       "the degree must be at least 1 and divide the number of processes, 4"},
      {"--expert-parallel 4 --set model.n_routed_experts=6",
       "the degree must divide the experts of a MoE layer, 6"},
      {"--expert-parallel 2 --set mtp=false --set model.first_k_dense_replace=3",
       "the model has no MoE layer"}};
  for (const auto& [args, message] : bad_ep) {
    EXPECT_EQ(train(4, "--config train.json --out ep " + args), 2) << args;
    EXPECT_NE(read("err.txt").find(message), std::string::npos) << args << ": " << read("err.txt");
    EXPECT_FALSE(fs::exists(dir_ / "ep")) << args;
  }
}

}  // namespace
}  // namespace hlm
