// The `hybridlm` command tried as a careless or hostile user would (docs/robustness.md), one test
// per item of the hardening list: the built binary is run as a child process (with a time limit,
// its peak memory measured), and every refusal must be exit status 2 with one line on stderr,
// quickly, without allocating gigabytes, and without touching what it must not touch. Skips when
// the binary has not been built.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/device.h"
#include "core/rng.h"
#include "core/safetensors.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/hybrid_model.h"
#include "testing.h"

namespace hlm {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const char* const kModel = testing::kSmallModelJson;

const char* kTrain = R"({
  "model": "model.json", "steps": 4, "tokens_per_step": 64, "lr": 0.01,
  "warmup_steps": 1, "eval_interval": 0, "eval_batches": 1, "log_interval": 1,
  "checkpoint_interval": 0, "mqar": {"min_pairs": 2, "max_pairs": 4}
})";

struct Result {
  bool exited = false;
  int code = -1;   // exit status when exited
  int signal = 0;  // the terminating signal otherwise
  bool timed_out = false;
  long maxrss_mb = 0;
  double seconds = 0;
  std::string out, err;
};

class RobustCli : public ::testing::Test {
 protected:
  void SetUp() override {
    bin_ = std::string(HLM_BINARY_DIR) + "/hybridlm";
    if (!fs::exists(bin_)) GTEST_SKIP() << "binary " << bin_ << " not built (ninja hybridlm)";
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / fmt::format("hlm_robust_{}_{}", ::getpid(), info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::ofstream(path("model.json")) << kModel;
    std::ofstream(path("train.json")) << kTrain;
    static const long idle = run({"--help"}).maxrss_mb;
    idle_mb_ = idle;
  }
  void TearDown() override {
    for (pid_t p : live_) {  // a child a failed assertion left running
      ::kill(p, SIGKILL);
      ::waitpid(p, nullptr, 0);
    }
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  std::string path(const std::string& n) const { return (dir_ / n).string(); }
  std::string read(const std::string& p) const {
    std::ifstream f(p, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }

  // Starts `hybridlm args...` in the test directory with `env` added (OMP_NUM_THREADS=1).
  pid_t start(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
    ++calls_;
    out_ = path(fmt::format("out{}.txt", calls_));
    err_ = path(fmt::format("err{}.txt", calls_));
    const pid_t pid = ::fork();
    if (pid == 0) {
      if (::chdir(dir_.c_str()) != 0) ::_exit(120);
      const int o = ::open(out_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      const int e = ::open(err_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (o < 0 || e < 0) ::_exit(121);
      ::dup2(o, 1);
      ::dup2(e, 2);
      ::setenv("OMP_NUM_THREADS", "1", 1);
      for (const auto& kv : env) {
        const size_t eq = kv.find('=');
        ::setenv(kv.substr(0, eq).c_str(), kv.substr(eq + 1).c_str(), 1);
      }
      std::vector<char*> argv{const_cast<char*>(bin_.c_str())};
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(bin_.c_str(), argv.data());
      ::_exit(122);
    }
    started_ = std::chrono::steady_clock::now();
    live_.push_back(pid);
    return pid;
  }
  Result finish(pid_t pid, double timeout_s = 120) {
    Result r;
    int st = 0;
    struct rusage ru = {};
    for (;;) {
      const pid_t w = ::wait4(pid, &st, WNOHANG, &ru);
      if (w == pid) break;
      if (std::chrono::steady_clock::now() - started_ > std::chrono::duration<double>(timeout_s)) {
        r.timed_out = true;
        ::kill(pid, SIGKILL);
        ::wait4(pid, &st, 0, &ru);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    live_.erase(std::remove(live_.begin(), live_.end(), pid), live_.end());
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
    r.exited = WIFEXITED(st);
    r.code = r.exited ? WEXITSTATUS(st) : -1;
    r.signal = WIFSIGNALED(st) ? WTERMSIG(st) : 0;
    r.maxrss_mb = ru.ru_maxrss / 1024;
    r.out = read(out_);
    r.err = read(err_);
    return r;
  }
  Result run(const std::vector<std::string>& args, const std::vector<std::string>& env = {},
             double timeout_s = 120) {
    return finish(start(args, env), timeout_s);
  }
  // The peak resident size of `hybridlm --help`, in MB: what the binary and its shared libraries
  // take before any work (about 200 MB more where it links cuBLAS than in a CPU build). A forked
  // child's ru_maxrss also counts the pages it shared with this process at fork, so this
  // baseline is measured the same way as every run it is compared with.
  long idle_mb() const { return idle_mb_; }
  // A refusal: exit 2, one line on stderr containing every needle, quickly, and using at most
  // max_mb more memory than the idle binary.
  ::testing::AssertionResult refused(const Result& r, std::initializer_list<std::string> needles,
                                     double max_s = 20, long max_mb = 400) {
    auto fail = [&] {
      return ::testing::AssertionFailure()
             << "exit " << r.code << " signal " << r.signal << " timed out " << r.timed_out
             << " in " << r.seconds << " s, " << r.maxrss_mb << " MB; stderr: " << r.err;
    };
    if (r.timed_out || !r.exited || r.code != 2) return fail();
    if (r.err.empty() || r.err.find('\n') != r.err.size() - 1) return fail() << " (not one line)";
    if (r.err.find("internal error") != std::string::npos) return fail();
    for (const auto& n : needles)
      if (r.err.find(n) == std::string::npos) return fail() << " (lacks '" << n << "')";
    if (r.seconds > max_s) return fail() << " (too slow)";
    if (r.maxrss_mb > idle_mb() + max_mb)
      return fail() << " (too much memory: the idle binary takes " << idle_mb() << " MB)";
    return ::testing::AssertionSuccess();
  }
  // A small checkpoint directory of kModel (random weights) for `forward`.
  std::string make_checkpoint(const std::string& name, bool mtp = false) {
    const ModelConfig cfg = ModelConfig::from_json(json::parse(kModel), "model");
    HybridModelOptions o;
    o.mtp = mtp;
    HybridModel m(cfg, o);
    checkpoint::save_module(path(name), m, &cfg);
    return path(name);
  }
  // The port a `serve --port 0` just started prints ("http://127.0.0.1:PORT"); 0 after 20 s.
  int wait_for_port() {
    for (int i = 0; i < 400; ++i) {
      const std::string o = read(out_);
      const size_t at = o.find("http://127.0.0.1:");
      if (at != std::string::npos) return std::atoi(o.c_str() + at + 17);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return 0;
  }
  void write_tokens(const std::string& name, const safetensors::TensorMap& m) {
    safetensors::save(path(name), m);
  }

  std::string bin_, out_, err_;
  fs::path dir_;
  std::vector<pid_t> live_;
  int calls_ = 0;
  long idle_mb_ = 0;
  std::chrono::steady_clock::time_point started_;
};

safetensors::TensorMap cast_input() {
  return {{"x", Tensor::from_values({2, 2}, {1.0, -2.5, 3.25, 1e-3}, DType::f32)}};
}

// ---- item 1: --out -----------------------------------------------------------------------------

TEST_F(RobustCli, OutNeverReplacesAFifoDirectoryOrDeviceAndWritesThroughSymlinks) {
  safetensors::save(path("x.safetensors"), cast_input());
  const std::vector<std::string> cast{"op",   "cast",          "--to", "bf16",
                                      "--in", "x.safetensors", "--out"};
  auto with_out = [&](const std::string& out) {
    auto a = cast;
    a.push_back(out);
    return run(a);
  };
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0600), 0);
  EXPECT_TRUE(refused(with_out("fifo"), {"is a FIFO"}));
  EXPECT_TRUE(fs::is_fifo(dir_ / "fifo"));
  fs::create_directories(dir_ / "d");
  EXPECT_TRUE(refused(with_out("d"), {"is a directory"}));
  EXPECT_TRUE(fs::is_directory(dir_ / "d"));
  if (::geteuid() == 0) {
    // As root the atomic save renamed its temporary over a device node (`--out /dev/null`
    // replaced /dev/null by a regular file): a private node of the same device.
    ASSERT_EQ(::mknod(path("null").c_str(), S_IFCHR | 0666, makedev(1, 3)), 0);
    EXPECT_TRUE(refused(with_out("null"), {"is a character device"}));
    EXPECT_TRUE(fs::is_character_file(dir_ / "null"));
  }
  // A symlink given as --out is written through, not replaced.
  fs::create_directories(dir_ / "store");
  fs::create_symlink("store/y.safetensors", dir_ / "y_link");
  const Result ok = with_out("y_link");
  ASSERT_EQ(ok.code, 0) << ok.err;
  EXPECT_TRUE(fs::is_symlink(dir_ / "y_link"));
  EXPECT_EQ(safetensors::load(path("store/y.safetensors")).tensors.at("y").numel(), 4);
  // Under a regular file, in a missing directory.
  std::ofstream(path("plain")) << "x";
  EXPECT_TRUE(refused(with_out("plain/y.safetensors"), {"is a regular file, not a directory"}));
  EXPECT_TRUE(refused(with_out("missing/y.safetensors"), {"does not exist"}));
}

// ---- items 2, 3, 4: sizes, counts, memory -------------------------------------------------------

TEST_F(RobustCli, AbsurdModelSizesAreRefusedQuicklyWithoutAllocating) {
  for (const char* set : {"model.hidden_size=4611686018427387904", "model.hidden_size=1000000000",
                          "model.vocab_size=1000000000000", "model.n_routed_experts=1000000000",
                          "model.hc_mult=1000000", "model.linear_conv_kernel_dim=1000000",
                          "model.hc_sinkhorn_iters=1000000000"}) {
    SCOPED_TRACE(set);
    const std::string field = std::string(set).substr(6, std::string(set).find('=') - 6);
    EXPECT_TRUE(refused(run({"train", "--config", "train.json", "--out", "r", "--set", set}),
                        {"'" + field + "'", "more than the limit of"}));
    EXPECT_FALSE(fs::exists(dir_ / "r"));
  }
}

TEST_F(RobustCli, AStepTooLargeForMemoryIsRefusedAndLeavesNoDirectory) {
  const Result r =
      run({"train", "--config", "train.json", "--out", "big", "--set", "tokens_per_step=10000000"},
          {"HLM_MEMORY_LIMIT=4G"});
  EXPECT_TRUE(refused(r, {"a training step of 10000000 tokens needs at least",
                          "memory limit of 4294967296 bytes"}));
  EXPECT_FALSE(fs::exists(dir_ / "big"));
}

TEST_F(RobustCli, OutOfRangeNumbersAreRefusedNotSaturated) {
  EXPECT_TRUE(refused(
      run({"train", "--config", "train.json", "--out", "r", "--steps", "99999999999999999999"}),
      {"--steps", "out of range", "1000000000"}));
  EXPECT_TRUE(refused(run({"train", "--config", "train.json", "--out", "r", "--steps", "0"}),
                      {"--steps", "out of range"}));
  EXPECT_TRUE(refused(run({"train", "--config", "train.json", "--out", "r", "--steps", "1e3"}),
                      {"--steps", "not an integer"}));
  EXPECT_TRUE(refused(run({"train", "--config", "train.json", "--out", "r", "--stop-after", "-1"}),
                      {"--stop-after", "out of range"}));
  EXPECT_TRUE(
      refused(run({"train", "--config", "train.json", "--out", "r", "--set", "steps=99999999999"}),
              {"'steps' is 99999999999, more than the limit of 1000000000"}));
  EXPECT_FALSE(fs::exists(dir_ / "r"));
}

TEST_F(RobustCli, InputsThatAreNotRegularFilesAreRefusedAtOnce) {
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0600), 0);
  const std::string ckpt = make_checkpoint("ckpt");
  // A FIFO with no writer blocked every reader for ever.
  EXPECT_TRUE(refused(run({"op", "cast", "--to", "bf16", "--in", "fifo", "--out", "y"}, {}, 30),
                      {"is a FIFO"}));
  EXPECT_TRUE(refused(run({"op", "kda", "--in", "fifo", "--out", "y"}, {}, 30), {"is a FIFO"}));
  EXPECT_TRUE(refused(run({"forward", "--model", ckpt, "--tokens", "fifo", "--out", "y"}, {}, 30),
                      {"is a FIFO"}));
  EXPECT_TRUE(
      refused(run({"train", "--config", "train.json", "--out", "r", "--data", "fifo"}, {}, 30),
              {"is a FIFO"}));
  EXPECT_TRUE(refused(run({"train", "--config", "fifo", "--out", "r"}, {}, 30), {"is a FIFO"}));
  // Through a training config's "data" key (no CLI check on that path: the reader's own).
  std::ofstream(path("fifo_data.json"))
      << R"({"model": "model.json", "steps": 2, "tokens_per_step": 64, "data": "fifo"})";
  EXPECT_TRUE(refused(
      run({"train", "--config", "fifo_data.json", "--out", "r", "--set", "model.vocab_size=258"},
          {}, 30),
      {"is a FIFO"}));
  // A directory as --in: "internal error" (exit 1) before.
  fs::create_directories(dir_ / "d");
  EXPECT_TRUE(
      refused(run({"op", "cast", "--to", "bf16", "--in", "d", "--out", "y"}), {"is a directory"}));
  // --out of a training run under a regular file: a filesystem_error (exit 1) before.
  std::ofstream(path("plain")) << "x";
  EXPECT_TRUE(refused(run({"train", "--config", "train.json", "--out", "plain/run"}),
                      {"plain/run", "cannot be created"}));
  EXPECT_FALSE(fs::exists(dir_ / "y"));
}

// ---- item 5: bad input accepted silently --------------------------------------------------------

TEST_F(RobustCli, ForwardRefusesTokenInputsItUsedToMisread) {
  const std::string ckpt = make_checkpoint("ckpt");
  auto fwd = [&](const std::string& tokens, std::vector<std::string> extra = {},
                 std::vector<std::string> env = {}) {
    std::vector<std::string> a{"forward", "--model", ckpt, "--tokens", tokens, "--out", "o"};
    a.insert(a.end(), extra.begin(), extra.end());
    return run(a, env);
  };
  // Float ids: 5.7 was read as 5, NaN and 1e30 through an undefined cast.
  write_tokens("f.st", {{"input_ids", Tensor::from_values({1, 3}, {1, 5.7, 2}, DType::f32)}});
  EXPECT_TRUE(refused(fwd("f.st"), {"input_ids must be an integer tensor", "f32"}));
  write_tokens("nan.st",
               {{"input_ids", Tensor::from_values({3}, {1, std::nan(""), 1e30}, DType::f64)}});
  EXPECT_TRUE(refused(fwd("nan.st"), {"input_ids must be an integer tensor"}));
  // cu_seqlens as F32 / U8 were accepted; next to [B, T] ids it was ignored.
  const Tensor ids = Tensor::from_vector<int64_t>({5}, {1, 2, 3, 4, 5});
  write_tokens("cuf.st", {{"input_ids", ids},
                          {"cu_seqlens", Tensor::from_values({3}, {0, 3, 5}, DType::f32)}});
  EXPECT_TRUE(refused(fwd("cuf.st"), {"cu_seqlens must be I64 or I32", "f32"}));
  write_tokens("cuu.st", {{"input_ids", ids},
                          {"cu_seqlens", Tensor::from_values({3}, {0, 3, 5}, DType::u8)}});
  EXPECT_TRUE(refused(fwd("cuu.st"), {"cu_seqlens must be I64 or I32", "u8"}));
  write_tokens("cu2d.st", {{"input_ids", ids.view({1, 5})},
                           {"cu_seqlens", Tensor::from_vector<int64_t>({3}, {0, 3, 5})}});
  EXPECT_TRUE(refused(fwd("cu2d.st"), {"cu_seqlens is given with [B, T] input_ids"}));
  write_tokens("extra.st",
               {{"input_ids", ids}, {"attention_mask", Tensor::zeros({5}, DType::i64)}});
  EXPECT_TRUE(refused(fwd("extra.st"), {"unexpected tensor 'attention_mask'"}));
  write_tokens("oov.st", {{"input_ids", Tensor::from_vector<int64_t>({2}, {3, 24})}});
  EXPECT_TRUE(refused(fwd("oov.st"), {"outside the vocabulary [0, 24)"}));
  // [T] ids with cu_seqlens: the summary counts the sequences (it said "in 1 sequence(s)").
  write_tokens("ok.st",
               {{"input_ids", ids}, {"cu_seqlens", Tensor::from_vector<int32_t>({3}, {0, 3, 5})}});
  Result r = fwd("ok.st");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("5 token(s) in 2 sequence(s)"), std::string::npos) << r.out;
  // A --dsa-indices value of -2^32 wrapped to index 0.
  write_tokens("rows.st", {{"input_ids", ids.view({1, 5})}});
  Tensor sel = Tensor::full({1, 5, 2}, -1.0, DType::i64);
  sel.data<int64_t>()[3] = -(int64_t(1) << 32);
  write_tokens("sel.st", {{"layers.1", sel}});
  EXPECT_TRUE(refused(fwd("rows.st", {"--dsa-indices", "sel.st"}),
                      {"layers.1[0, 1, 1] = -4294967296", "expected -1 (padding)"}));
  write_tokens("sel0.st", {{"layers.0", Tensor::full({1, 5, 2}, -1.0, DType::i64)}});
  EXPECT_TRUE(refused(fwd("rows.st", {"--dsa-indices", "sel0.st"}),
                      {"'layers.0' is not the selection of a DSA layer"}));
  // Item 4: 100,000 tokens are refused from the shapes, before the model is built.
  write_tokens("long.st", {{"input_ids", Tensor::zeros({100000}, DType::i64)}});
  EXPECT_TRUE(refused(
      fwd("long.st", {}, {"HLM_MEMORY_LIMIT=1G"}),
      {"forward on long.st needs at least", "100000 tokens", "memory limit of 1073741824 bytes"}));
  // A config claiming a larger model than its checkpoint (about 16 GB of experts): refused from
  // the headers before the model is built.
  json c = json::parse(read(ckpt + "/config.json"));
  c["moe_intermediate_size"] = 1048576;
  c["n_shared_experts"] = 64;
  std::ofstream(ckpt + "/config.json") << c.dump();
  EXPECT_TRUE(refused(fwd("ok.st"), {"do not match"}, 20, 200));
  EXPECT_FALSE(fs::exists(dir_ / "o.safetensors"));
}

// ---- a transformers checkpoint (tests/data/hf_glm5_next) through the commands ----------------

TEST_F(RobustCli, InspectAndForwardReadAPublishedCheckpointAsItIs) {
  const std::string hf = std::string(HLM_SOURCE_DIR) + "/tests/data/hf_glm5_next";
  Result r = run({"inspect", hf, "--seq-len", "1024"});
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* line :
       {"pattern      KDK", "mlp          dEE", "GEMMs native (the checkpoint's dtype float32)",
        "published layout, 107 tensors, 41614 values (= the config's model without lm_head)",
        "decode cache one sequence of 1024 tokens",
        "hybridlm cache one sequence of 1024 tokens, f32, cpu (generate / serve)",
        "hybridlm cache one sequence of 1024 tokens, f32, cuda (generate / serve)", "latents f32)"})
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << r.out;
  EXPECT_TRUE(refused(run({"inspect", path("missing")}), {"cannot open the file"}));
  EXPECT_TRUE(refused(run({"inspect", hf, "--seq-len", "0"}), {"--seq-len"}));
  // --parallel lays a step out over GPUs (model/parallel_plan.h); a layout that does not fit is
  // refused before anything is printed.
  const std::string flash = std::string(HLM_SOURCE_DIR) + "/configs/glm5_3_flash.json";
  r = run({"inspect", flash, "--seq-len", "8192", "--parallel", "dp=8,ep=8,cp=2"});
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* line :
       {"dp 8 x cp 2 x tp 1 = 16 GPUs; routed experts over ep 8 (36 per GPU)",
        "groups       of rank 0: tp {0}, cp {0, 1}, dp {0, 2, 4,",
        "per GPU      4096 tokens of a step of 65536", "ep all-to-all", "latents bf16)"})
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << r.out;
  r = run({"inspect", flash, "--parallel", "dp=3,ep=2"});
  EXPECT_TRUE(refused(r, {"ep = 2 must divide dp x cp = 3"}));
  EXPECT_EQ(r.out, "");
  EXPECT_TRUE(refused(run({"inspect", flash, "--parallel", "dp=8,xx=1"}), {"unknown key 'xx'"}));

  // forward with no config edit: the layout and precision in one line; gradients named as the
  // file names the parameters, or as PyTorch's module tree.
  const std::vector<std::string> fwd = {"forward",
                                        "--model",
                                        hf,
                                        "--tokens",
                                        hf + "/tokens.safetensors",
                                        "--grad-probe",
                                        hf + "/probe.safetensors"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = fwd;
    a.insert(a.end(), extra.begin(), extra.end());
    return run(a);
  };
  r = with({"--out", "g.safetensors"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("in the published layout; computing in f32; GEMMs native"),
            std::string::npos)
      << r.out;
  const auto g = safetensors::load(path("g.safetensors")).tensors;
  EXPECT_TRUE(g.count("grad.layers.1.mlp.experts.3.up_proj.weight"));
  EXPECT_TRUE(g.count("grad.layers.0.self_attn.q_conv1d.weight"));
  EXPECT_TRUE(g.count("grad.layers.0.hc_attn_fn"));
  EXPECT_FALSE(g.count("logits"));
  r = with({"--out", "t.safetensors", "--grad-layout", "module_tree"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto t = safetensors::load(path("t.safetensors")).tensors;
  EXPECT_TRUE(t.count("grad.model.layers.1.mlp.experts.gate_up_proj"));
  EXPECT_TRUE(t.count("grad.model.layers.0.attn_hc.fn"));
  EXPECT_EQ(g.size(), t.size() + 4 * 2 * 3 - 2 * 2 + 2 * 2);  // experts split, convs split
  // The same gradient, two names.
  EXPECT_TRUE(testing::bit_equal(
      g.at("grad.layers.1.mlp.experts.3.up_proj.weight"),
      t.at("grad.model.layers.1.mlp.experts.gate_up_proj").select(0, 3).slice(0, 16, 32)));
  EXPECT_TRUE(refused(with({"--out", "l.safetensors", "--logits"}),
                      {"forward --logits", "has no lm_head.weight"}));
  EXPECT_FALSE(fs::exists(dir_ / "l.safetensors"));

  // A checkpoint with an expert missing: one line naming it, exit 2, nothing written.
  fs::create_directories(dir_ / "bad");
  fs::copy_file(hf + "/config.json", dir_ / "bad/config.json");
  auto m = safetensors::load(hf + "/model.safetensors").tensors;
  m.erase("layers.2.mlp.experts.1.down_proj.weight");
  safetensors::save(path("bad/model.safetensors"), m);
  EXPECT_TRUE(refused(run({"forward", "--model", path("bad"), "--tokens",
                           hf + "/tokens.safetensors", "--out", "b.safetensors"}),
                      {"model.layers.2.mlp.experts.1.down_proj.weight"}));
  EXPECT_FALSE(fs::exists(dir_ / "b.safetensors"));
}

TEST_F(RobustCli, ConvertRewritesLayoutsDtypesAndShardsKeepingEveryTensor) {
  const std::string hf = std::string(HLM_SOURCE_DIR) + "/tests/data/hf_glm5_next";
  auto tensors = [](const std::string& dir) { return checkpoint::read_checkpoint(dir); };
  const auto original = tensors(hf);
  ASSERT_EQ(run({"convert", "--model", hf, "--out", "tree", "--layout", "module_tree"}).code, 0);
  const auto tree = tensors(path("tree"));
  EXPECT_TRUE(tree.count("model.layers.1.mlp.experts.gate_up_proj"));
  EXPECT_LT(tree.size(), original.size());
  Result r = run({"convert", "--model", path("tree"), "--out", "back"});  // stays module_tree
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("(module_tree layout) -> "), std::string::npos) << r.out;
  ASSERT_EQ(run({"convert", "--model", path("back"), "--out", "pub", "--layout", "published",
                 "--shard-size", "40000"})
                .code,
            0);
  EXPECT_TRUE(fs::exists(dir_ / "pub" / checkpoint::kIndexFile));
  const auto pub = tensors(path("pub"));
  ASSERT_EQ(pub.size(), original.size());
  for (const auto& [name, t] : original) {  // every tensor back, bit for bit, dtype included
    ASSERT_TRUE(pub.count(name)) << name;
    EXPECT_EQ(pub.at(name).dtype(), t.dtype()) << name;
    EXPECT_TRUE(testing::bit_equal(pub.at(name), t)) << name;
  }
  ASSERT_EQ(run({"convert", "--model", hf, "--out", "half", "--dtype", "bf16"}).code, 0);
  const auto half = tensors(path("half"));
  EXPECT_EQ(half.at("model.layers.0.self_attn.q_proj.weight").dtype(), DType::bf16);
  EXPECT_EQ(half.at("model.layers.0.self_attn.A_log").dtype(), DType::f32);  // keep-in-FP32
  EXPECT_TRUE(
      refused(run({"convert", "--model", hf, "--out", hf}), {"is the checkpoint being read"}));
  EXPECT_TRUE(
      refused(run({"convert", "--model", hf, "--out", "x", "--layout", "hf"}), {"--layout"}));
  EXPECT_FALSE(fs::exists(dir_ / "x"));
}

TEST_F(RobustCli, ForwardWritesLogitsWhenAsked) {
  const std::string ckpt = make_checkpoint("ckpt");
  write_tokens("ids.st", {{"input_ids", Tensor::from_vector<int64_t>({2, 3}, {1, 2, 3, 4, 5, 6})}});
  Result r = run({"forward", "--model", ckpt, "--tokens", "ids.st", "--out", "o.st", "--logits"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto o = safetensors::load(path("o.st")).tensors;
  ASSERT_TRUE(o.count("logits"));
  EXPECT_EQ(o.at("logits").shape(), (Shape{2, 3, 24}));
  EXPECT_EQ(o.at("logits").dtype(), DType::f32);
  r = run({"forward", "--model", ckpt, "--tokens", "ids.st", "--out", "n.st"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(safetensors::load(path("n.st")).tensors.count("logits"));
}

// `generate` as a user runs it: greedy tokens are the arg max of `forward --logits` over the
// prompt and the tokens before them, and the log-probabilities written are that forward's
// log-softmax (the numbers a trainer computes for the same tokens).
TEST_F(RobustCli, GenerateIsTheForwardsArgMaxWithItsLogProbabilities) {
  const std::string ckpt = make_checkpoint("ckpt");
  const std::vector<int64_t> prompt = {3, 1, 4, 1, 5, 9, 2};
  write_tokens("ids.st", {{"input_ids", Tensor::from_vector<int64_t>({7}, prompt)}});
  Result r = run({"generate", "--model", ckpt, "--tokens", "ids.st", "--max-new", "9", "--stop",
                  "23", "--logprobs", "--prompt-logprobs", "--out", "g.st"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("tokens/s"), std::string::npos) << r.err;
  const auto g = safetensors::load(path("g.st")).tensors;
  const Tensor toks = g.at("tokens"), lp = g.at("logprobs"), plp = g.at("prompt_logprobs");
  const int64_t N = toks.numel();
  ASSERT_GE(N, 1);
  std::vector<int64_t> all = prompt;
  for (int64_t i = 0; i < N; ++i) all.push_back(toks.data<int64_t>()[i]);
  // The streamed ids are the written ones.
  std::string streamed;
  for (int64_t i = 0; i < N; ++i) streamed += std::to_string(toks.data<int64_t>()[i]) + " ";
  EXPECT_EQ(r.out, streamed + "\n");
  write_tokens("all.st", {{"input_ids", Tensor::from_vector<int64_t>({int64_t(all.size())}, all)}});
  r = run({"forward", "--model", ckpt, "--tokens", "all.st", "--out", "f.st", "--logits"});
  ASSERT_EQ(r.code, 0) << r.err;
  const Tensor L = safetensors::load(path("f.st")).tensors.at("logits").contiguous();
  const int64_t V = L.size(1), P = int64_t(prompt.size());
  auto log_softmax_at = [&](int64_t row, int64_t tok) {
    const float* x = L.data<float>() + row * V;
    double m = -1e300, s = 0;
    for (int64_t v = 0; v < V; ++v) m = std::max(m, double(x[v]));
    for (int64_t v = 0; v < V; ++v) s += std::exp(double(x[v]) - m);
    return double(x[tok]) - m - std::log(s);
  };
  for (int64_t i = 0; i < N; ++i) {
    const float* x = L.data<float>() + (P - 1 + i) * V;
    EXPECT_EQ(all[size_t(P + i)], int64_t(std::max_element(x, x + V) - x)) << "token " << i;
    EXPECT_NEAR(lp.data<float>()[i], log_softmax_at(P - 1 + i, all[size_t(P + i)]), 2e-5);
  }
  ASSERT_EQ(plp.numel(), P - 1);
  for (int64_t i = 0; i + 1 < P; ++i)
    EXPECT_NEAR(plp.data<float>()[i], log_softmax_at(i, prompt[size_t(i + 1)]), 2e-5);
  // --speculative needs the MTP weights, and then gives the same tokens.
  EXPECT_TRUE(refused(run({"generate", "--model", ckpt, "--tokens", "ids.st", "--speculative"}),
                      {"needs the MTP block's weights (model.layers.2.*)"}));
  const std::string with_mtp = make_checkpoint("ckpt_mtp", true);
  r = run(
      {"generate", "--model", with_mtp, "--tokens", "ids.st", "--max-new", "9", "--out", "s0.st"});
  ASSERT_EQ(r.code, 0) << r.err;
  r = run({"generate", "--model", with_mtp, "--tokens", "ids.st", "--max-new", "9", "--out",
           "s1.st", "--speculative"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("MTP drafts accepted"), std::string::npos) << r.err;
  EXPECT_TRUE(testing::bit_equal(safetensors::load(path("s1.st")).tensors.at("tokens"),
                                 safetensors::load(path("s0.st")).tensors.at("tokens")));
}

TEST_F(RobustCli, GenerateRefusesBadRequests) {
  const std::string ckpt = make_checkpoint("ckpt");
  write_tokens("ids.st", {{"input_ids", Tensor::from_vector<int64_t>({3}, {1, 2, 3})}});
  write_tokens("big.st", {{"input_ids", Tensor::from_vector<int64_t>({3}, {1, 24, 3})}});
  const std::string m = ckpt;
  EXPECT_TRUE(refused(run({"generate", "--model", m, "--tokens", "big.st"}), {"24"}));
  EXPECT_TRUE(refused(run({"generate", "--model", m}), {"one of --prompt TEXT and --tokens"}));
  EXPECT_TRUE(refused(run({"generate", "--model", m, "--tokens", "ids.st", "--prompt", "hi"}),
                      {"one of --prompt TEXT and --tokens"}));
  EXPECT_TRUE(refused(run({"generate", "--model", m, "--prompt", "hi"}), {"no tokenizer.json"}));
  EXPECT_TRUE(refused(run({"generate", "--model", m, "--tokens", "ids.st", "--max-new", "-1"}),
                      {"--max-new"}));
  EXPECT_TRUE(refused(run({"generate", "--model", m, "--tokens", "ids.st", "--temperature", "nan"}),
                      {"temperature"}));
  EXPECT_TRUE(refused(
      run({"generate", "--model", m, "--tokens", "ids.st", "--temperature", "1", "--top-p", "1.5"}),
      {"top_p"}));
  EXPECT_TRUE(refused(run({"generate", "--model", m, "--tokens", "ids.st", "--logprobs"}),
                      {"--logprobs and --prompt-logprobs are written to --out"}));
  EXPECT_TRUE(refused(run({"generate", "--model", m, "--tokens", "ids.st", "--stop", "99"}),
                      {"stop token 99"}));
  std::ofstream(path("taken.st")) << "x";
  EXPECT_TRUE(refused(run({"generate", "--model", m, "--tokens", "ids.st", "--out", "taken.st"}),
                      {"exists"}));
  EXPECT_EQ(read(path("taken.st")), "x");
  EXPECT_TRUE(refused(run({"generate", "--model", path("none"), "--tokens", "ids.st"}), {"none"}));
  EXPECT_TRUE(refused(run({"generate", "--model", m, "--tokens", "ids.st", "--device", "gpu"}),
                      {"--device"}));
  EXPECT_TRUE(refused(
      run({"generate", "--model", m, "--tokens", "ids.st", "--device", "cuda", "--dtype", "f64"}),
      {cuda_available() ? "computes in f32" : "no CUDA device is present"}));
}

// `serve` on a loopback port: concurrent requests (greedy and seeded sampling, one streamed)
// from clients in this test get the answers `generate` gives for the same prompts and settings,
// while malformed requests sent alongside get HTTP 400 with a JSON message and harm nothing;
// SIGINT stops the server with status 0.
TEST_F(RobustCli, ServeAnswersConcurrentRequestsAsGenerateDoes) {
  const std::string ckpt = make_checkpoint("ckpt");
  const pid_t server =
      start({"serve", "--model", ckpt, "--port", "0", "--max-batch", "3", "--cache-tokens", "128"});
  const int port = wait_for_port();
  ASSERT_GT(port, 0) << read(out_) << read(err_);
  struct Ask {
    std::vector<int64_t> prompt;
    double temperature;
    bool stream;
    json answer;
    std::vector<int64_t> streamed;
    int status = 0;
  };
  std::vector<Ask> asks;
  for (int i = 0; i < 6; ++i) {
    std::vector<int64_t> p;
    for (int j = 0; j < 2 + 3 * i; ++j) p.push_back((7 * i + 5 * j + 1) % 24);
    asks.push_back({p, i % 3 == 2 ? 0.9 : 0.0, i == 4, json(), {}, 0});
  }
  std::vector<std::thread> th;
  for (Ask& a : asks)
    th.emplace_back([&a, port] {
      httplib::Client c("127.0.0.1", port);
      c.set_read_timeout(60, 0);
      const json body = {{"prompt", a.prompt}, {"max_tokens", 6}, {"temperature", a.temperature},
                         {"top_k", 5},         {"seed", 3},       {"logprobs", 1},
                         {"stream", a.stream}};
      auto r = c.Post("/v1/completions", body.dump(), "application/json");
      if (!r) return;
      a.status = r->status;
      if (!a.stream) {
        a.answer = json::parse(r->body, nullptr, false);
        return;
      }
      std::istringstream in(r->body);
      for (std::string line; std::getline(in, line);)
        if (line.rfind("data: {", 0) == 0) {
          const json chunk = json::parse(line.substr(6));
          for (const json& t : chunk["choices"][0]["token_ids"])
            a.streamed.push_back(t.get<int64_t>());
        }
    });
  // Malformed requests alongside.
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{not json", "not JSON"},
      {R"({"prompt": [1, 2, 99]})", "prompt token 2 is 99"},
      {R"({"prompt": [1], "max_tokens": -5})", "'max_tokens' must be in"},
      {R"({"prompt": [1], "temperature": "hot"})", "'temperature' must be a number"},
      {R"({"prompt": [1], "stop": ["\n"]})", "stop strings are not supported"},
      {R"({"prompt": "text"})", "needs the model's tokenizer.json"},
      {R"({"prompt": [1], "n": 2})", "'n' must be in"},
      {R"({"prompt": [1], "frequency_penalty": 1})", "unknown field 'frequency_penalty'"},
      {R"([1, 2])", "must be a JSON object"},
      {R"({"prompt": [], "max_tokens": 2})", "the prompt is empty"},
      {R"({"prompt": [1], "max_tokens": 200})", "the cache holds 128"}};
  for (const auto& [body, needle] : bad) {
    httplib::Client c("127.0.0.1", port);
    auto r = c.Post("/v1/completions", body, "application/json");
    ASSERT_TRUE(r) << body;
    EXPECT_EQ(r->status, 400) << body;
    const json e = json::parse(r->body, nullptr, false);
    ASSERT_TRUE(e.is_object() && e.contains("error")) << r->body;
    EXPECT_NE(e["error"]["message"].get<std::string>().find(needle), std::string::npos)
        << body << " -> " << r->body;
  }
  {  // A body over the limit is refused before it is read whole.
    httplib::Client c("127.0.0.1", port);
    auto r = c.Post("/v1/completions", std::string(size_t(65) << 20, ' '), "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 413);
  }
  for (auto& t : th) t.join();
  ::kill(server, SIGINT);
  const Result sr = finish(server, 30);
  EXPECT_TRUE(sr.exited && sr.code == 0) << sr.err;

  for (size_t i = 0; i < asks.size(); ++i) {
    const Ask& a = asks[i];
    ASSERT_EQ(a.status, 200) << "request " << i;
    write_tokens("p.st", {{"input_ids",
                           Tensor::from_vector<int64_t>({int64_t(a.prompt.size())}, a.prompt)}});
    fs::remove(path("g.st"));
    std::vector<std::string> args = {"generate",  "--model", ckpt,    "--tokens", "p.st",
                                     "--max-new", "6",       "--out", "g.st",     "--logprobs"};
    if (a.temperature > 0)
      for (const char* x : {"--temperature", "0.9", "--top-k", "5", "--seed", "3"})
        args.push_back(x);
    const Result g = run(args);
    ASSERT_EQ(g.code, 0) << g.err;
    const auto out = safetensors::load(path("g.st")).tensors;
    const Tensor toks = out.at("tokens");
    const std::vector<int64_t> want(toks.data<int64_t>(), toks.data<int64_t>() + toks.numel());
    if (a.stream) {
      EXPECT_EQ(a.streamed, want) << "streamed request " << i;
      continue;
    }
    const json& ch = a.answer["choices"][0];
    EXPECT_EQ(ch["token_ids"].get<std::vector<int64_t>>(), want) << "request " << i;
    const std::vector<double> lp = ch["logprobs"]["token_logprobs"].get<std::vector<double>>();
    ASSERT_EQ(int64_t(lp.size()), toks.numel());
    for (size_t j = 0; j < lp.size(); ++j)
      EXPECT_NEAR(lp[j], out.at("logprobs").data<float>()[j], 2e-5) << "request " << i;
    EXPECT_EQ(a.answer["usage"]["prompt_tokens"].get<int64_t>(), int64_t(a.prompt.size()));
  }
}

// `serve --speculative` drafts with the MTP block: greedy requests get plain greedy decoding's
// answers (generate's), a sampled one gets HTTP 400, and a checkpoint without the MTP block is
// refused at start.
TEST_F(RobustCli, ServeSpeculativeAnswersAsPlainGreedy) {
  EXPECT_TRUE(
      refused(run({"serve", "--model", make_checkpoint("plain"), "--port", "0", "--speculative"}),
              {"needs the MTP block's weights", "model.layers."}));
  const std::string ckpt = make_checkpoint("with_mtp", true);
  const pid_t server = start({"serve", "--model", ckpt, "--port", "0", "--max-batch", "2",
                              "--cache-tokens", "128", "--speculative"});
  const int port = wait_for_port();
  ASSERT_GT(port, 0) << read(out_) << read(err_);
  const std::vector<std::vector<int64_t>> prompts = {{3, 9, 1}, {5, 5, 20, 7, 2, 11}, {0}};
  std::vector<json> answers(prompts.size());
  std::vector<std::thread> th;
  for (size_t i = 0; i < prompts.size(); ++i)
    th.emplace_back([&, i] {
      httplib::Client c("127.0.0.1", port);
      c.set_read_timeout(60, 0);
      const json body = {{"prompt", prompts[i]}, {"max_tokens", 7}, {"temperature", 0}};
      auto r = c.Post("/v1/completions", body.dump(), "application/json");
      if (r && r->status == 200) answers[i] = json::parse(r->body, nullptr, false);
    });
  {
    httplib::Client c("127.0.0.1", port);
    auto r =
        c.Post("/v1/completions", R"({"prompt": [1, 2], "temperature": 0.7})", "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400);
    EXPECT_NE(r->body.find("greedy only"), std::string::npos) << r->body;
  }
  for (auto& t : th) t.join();
  ::kill(server, SIGINT);
  const Result sr = finish(server, 30);
  EXPECT_TRUE(sr.exited && sr.code == 0) << sr.err;
  EXPECT_NE(sr.err.find("serve: MTP drafts accepted"), std::string::npos) << sr.err;
  EXPECT_EQ(sr.err.find("accepted 0 of 0"), std::string::npos) << sr.err;
  for (size_t i = 0; i < prompts.size(); ++i) {
    write_tokens(
        "p.st",
        {{"input_ids", Tensor::from_vector<int64_t>({int64_t(prompts[i].size())}, prompts[i])}});
    fs::remove(path("g.st"));
    const Result g =
        run({"generate", "--model", ckpt, "--tokens", "p.st", "--max-new", "7", "--out", "g.st"});
    ASSERT_EQ(g.code, 0) << g.err;
    const Tensor toks = safetensors::load(path("g.st")).tensors.at("tokens");
    ASSERT_TRUE(answers[i].is_object()) << "request " << i;
    EXPECT_EQ(answers[i]["choices"][0]["token_ids"].get<std::vector<int64_t>>(),
              std::vector<int64_t>(toks.data<int64_t>(), toks.data<int64_t>() + toks.numel()))
        << "request " << i;
  }
}

TEST_F(RobustCli, NonUtf8HeaderBytesAreEscapedInTheErrorLine) {
  std::string h = "{\"x\xff\x1b[2J\":1}";
  std::vector<uint8_t> b(8 + h.size());
  b[0] = uint8_t(h.size());
  std::memcpy(b.data() + 8, h.data(), h.size());
  std::ofstream(path("bad.st"), std::ios::binary)
      .write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
  const Result r = run({"op", "cast", "--to", "bf16", "--in", "bad.st", "--out", "y"});
  EXPECT_TRUE(refused(r, {"bad.st"}));
  EXPECT_EQ(r.err.find('\xff'), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find('\x1b'), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("\\xff"), std::string::npos) << r.err;
}

TEST_F(RobustCli, OpKdaRefusesValuesOutsideTheGateRanges) {
  Rng rng(testing::test_seed());
  const int64_t T = 8, H = 1, K = 4, V = 4;
  safetensors::TensorMap m;
  m["q"] = randn({T, H, K}, DType::f32, rng, 0.3);
  m["k"] = randn({T, H, K}, DType::f32, rng, 0.3);
  m["v"] = randn({T, H, V}, DType::f32, rng);
  m["g"] = rand_uniform({T, H, K}, DType::f32, rng, -1.0, -0.1);
  m["beta"] = rand_uniform({T, H}, DType::f32, rng, 0.1, 0.9);
  m["cu_seqlens"] = Tensor::from_vector<int64_t>({2}, {0, T});
  safetensors::save(path("good.st"), m);
  Result r = run({"op", "kda", "--in", "good.st", "--out", "o"});
  ASSERT_EQ(r.code, 0) << r.err;
  auto with = [&](const std::string& name, int64_t at, double value) {
    safetensors::TensorMap b = m;
    b[name] = m[name].clone();
    b[name].data<float>()[at] = float(value);
    safetensors::save(path("bad.st"), b);
    return run({"op", "kda", "--in", "bad.st", "--out", "o2"});
  };
  EXPECT_TRUE(refused(with("beta", 3, 1.5), {"'beta' holds 1.5 at flat index 3", "[0, 1]"}));
  EXPECT_TRUE(refused(with("beta", 0, std::nan("")), {"'beta' holds nan"}));
  EXPECT_TRUE(refused(with("g", 5, 0.25), {"'g' holds 0.25 at flat index 5", "<= 0"}));
  EXPECT_TRUE(refused(with("q", 1, std::numeric_limits<double>::infinity()), {"'q' holds inf"}));
  EXPECT_FALSE(fs::exists(dir_ / "o2"));
}

// ---- items 6 and 7: two runs, signals
// ------------------------------------------------------------

// Waits until `pred` holds (or `seconds` pass).
template <class F>
bool wait_for(F&& pred, double seconds) {
  const auto t0 = std::chrono::steady_clock::now();
  while (!pred()) {
    if (std::chrono::steady_clock::now() - t0 > std::chrono::duration<double>(seconds))
      return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

TEST_F(RobustCli, ASecondRunOnTheSameOutIsRefusedAndCtrlCCheckpoints) {
  // A long run, its first steps logged.
  const pid_t a = start({"train", "--config", "train.json", "--out", "run", "--steps", "100000"});
  ASSERT_TRUE(wait_for(
      [&] { return read(path("run/metrics.jsonl")).find("\"step\":2") != std::string::npos; }, 120))
      << read(err_);
  const std::string a_out = out_, a_err = err_;
  const auto a_started = started_;
  // Another run on the same directory: refused naming the holder, even with --overwrite.
  Result b = run({"train", "--config", "train.json", "--out", "run", "--overwrite"});
  EXPECT_TRUE(refused(b, {"is in use by another training run", fmt::format("process {}", a)}));
  b = run({"train", "--resume", "run", "--steps", "100000"});
  EXPECT_TRUE(refused(b, {fmt::format("process {}", a)}));
  // Ctrl-C: the step finishes, a checkpoint is written, exit 130.
  ASSERT_EQ(::kill(a, SIGINT), 0);
  out_ = a_out, err_ = a_err, started_ = a_started;
  const Result ra = finish(a, 120);
  ASSERT_TRUE(ra.exited) << "signal " << ra.signal;
  EXPECT_EQ(ra.code, 130) << ra.err;
  EXPECT_NE(ra.out.find("interrupted by SIGINT after step"), std::string::npos) << ra.out;
  EXPECT_NE(ra.out.find("hybridlm train --resume run"), std::string::npos) << ra.out;
  const auto ck = safetensors::load(path("run/trainer_state.safetensors"));
  const int64_t step = std::stoll(ck.metadata.at("step"));
  EXPECT_GE(step, 2);
  // The run continues from there.
  const Result c = run({"train", "--resume", "run", "--steps", std::to_string(step + 2)});
  EXPECT_EQ(c.code, 0) << c.err;
  EXPECT_NE(c.out.find(fmt::format("resumed from run at step {}", step)), std::string::npos)
      << c.out;
}

TEST_F(RobustCli, SigtermCheckpointsAndExits143) {
  const pid_t a = start({"train", "--config", "train.json", "--out", "run", "--steps", "100000"});
  ASSERT_TRUE(wait_for(
      [&] { return read(path("run/metrics.jsonl")).find("\"step\":1") != std::string::npos; },
      120));
  ASSERT_EQ(::kill(a, SIGTERM), 0);
  const Result r = finish(a, 120);
  ASSERT_TRUE(r.exited) << "signal " << r.signal;
  EXPECT_EQ(r.code, 143) << r.err;
  EXPECT_NE(r.out.find("interrupted by SIGTERM"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(dir_ / "run" / "trainer_state.safetensors"));
}

TEST_F(RobustCli, StopAfterZeroAndARunStoppedBeforeItsFirstCheckpoint) {
  // --stop-after 0 was ignored (the run trained to the end).
  Result r = run({"train", "--config", "train.json", "--out", "zero", "--stop-after", "0"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(safetensors::load(path("zero/trainer_state.safetensors")).metadata.at("step"), "0");
  r = run({"train", "--resume", "zero"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(safetensors::load(path("zero/trainer_state.safetensors")).metadata.at("step"), "4");
  // What a run killed before its first checkpoint leaves (metrics, settings, no checkpoint):
  // --out accepts it without --overwrite; --resume says what to do.
  fs::create_directories(dir_ / "early");
  std::ofstream(path("early/metrics.jsonl")) << "{\"step\":1,\"loss\":3.1}\n";
  std::ofstream(path("early/train_config.json")) << "{}";
  r = run({"train", "--resume", "early"});
  EXPECT_TRUE(refused(r, {"holds no training checkpoint", "--out early"}));
  r = run({"train", "--config", "train.json", "--out", "early", "--steps", "2"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(safetensors::load(path("early/trainer_state.safetensors")).metadata.at("step"), "2");
}

}  // namespace
}  // namespace hlm
