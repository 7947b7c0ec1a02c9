// `hybridlm op kda` / `hybridlm op kda_gate` run as a user runs them (the built binary on
// safetensors files). Skips when the binary has not been built (ninja hybridlm).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "core/rng.h"
#include "core/safetensors.h"
#include "ops/kda.h"
#include "testing.h"

namespace hlm {
namespace {

namespace fs = std::filesystem;

class KdaCli : public ::testing::Test {
 protected:
  void SetUp() override {
    bin_ = std::string(HLM_BINARY_DIR) + "/hybridlm";
    if (!fs::exists(bin_)) GTEST_SKIP() << "binary " << bin_ << " not built (ninja hybridlm)";
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / fmt::format("hlm_kda_cli_{}_{}", ::getpid(), info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  std::string path(const std::string& n) const { return (dir_ / n).string(); }
  int run(const std::string& args) {
    const std::string cmd = bin_ + " " + args + " > " + path("out.txt") + " 2> " + path("err.txt");
    const int st = std::system(cmd.c_str());
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }
  std::string bin_;
  fs::path dir_;
};

safetensors::TensorMap make_inputs(DType dt, Rng& rng) {
  const int64_t T = 80, H = 1, HV = 2, K = 8, V = 4;
  safetensors::TensorMap m;
  Tensor q = randn({T, H, K}, dt, rng, 0.35), k = randn({T, H, K}, dt, rng, 0.35);
  m["q"] = q;
  m["k"] = k;
  m["v"] = randn({T, HV, V}, dt, rng);
  m["g"] = rand_uniform({T, HV, K}, dt, rng, -2, -0.01);
  m["beta"] = rand_uniform({T, HV}, dt, rng, 0.1, 0.9);
  m["cu_seqlens"] = Tensor::from_vector<int32_t>({3}, {0, 70, 80});
  m["initial_state"] = randn({2, HV, K, V}, dt, rng, 0.5);
  m["scale"] = Tensor::scalar(0.5, DType::f64);
  m["do"] = randn({T, HV, V}, dt, rng);
  m["dht"] = randn({2, HV, K, V}, dt, rng);
  return m;
}

TEST_F(KdaCli, KdaMatchesLibrary) {
  Rng rng(testing::test_seed());
  for (DType dt : {DType::f32, DType::f64})
    for (std::string impl : {"chunk", "recurrent"}) {
      auto m = make_inputs(dt, rng);
      safetensors::save(path("in.safetensors"), m);
      ASSERT_EQ(run("op kda --impl " + impl + " --backward --in " + path("in.safetensors") +
                    " --out " + path("o.safetensors")),
                0);
      auto r = safetensors::load(path("o.safetensors")).tensors;
      ops::KdaArgs a;
      a.q = m["q"], a.k = m["k"], a.v = m["v"], a.g = m["g"], a.beta = m["beta"];
      a.seqs = SeqLayout::from_tensor(m["cu_seqlens"], a.q.size(0));
      a.initial_state = m["initial_state"], a.scale = 0.5;
      auto f = impl == "chunk" ? ops::kda_chunk(a) : ops::kda_recurrent(a);
      auto g = impl == "chunk" ? ops::kda_chunk_backward(a, m["do"], m["dht"])
                               : ops::kda_recurrent_backward(a, m["do"], m["dht"]);
      EXPECT_EQ(r["o"].dtype(), dt);
      EXPECT_TRUE(testing::bit_equal(r["o"], f.o.to(dt)));
      EXPECT_TRUE(testing::bit_equal(r["final_state"], f.final_state.to(dt)));
      EXPECT_TRUE(testing::bit_equal(r["dq"], g.dq.to(dt)));
      EXPECT_TRUE(testing::bit_equal(r["dk"], g.dk.to(dt)));
      EXPECT_TRUE(testing::bit_equal(r["dv"], g.dv.to(dt)));
      EXPECT_TRUE(testing::bit_equal(r["dg"], g.dg.to(dt)));
      EXPECT_TRUE(testing::bit_equal(r["dbeta"], g.dbeta.to(dt)));
      EXPECT_TRUE(testing::bit_equal(r["dinitial_state"], g.dinitial_state.to(dt)));
    }
}

TEST_F(KdaCli, GateMatchesLibrary) {
  Rng rng(testing::test_seed());
  safetensors::TensorMap m;
  m["z"] = randn({10, 2, 8}, DType::f32, rng);
  m["A_log"] = rand_uniform({2}, DType::f32, rng, -1, 1);
  m["dt_bias"] = rand_uniform({16}, DType::f32, rng, -1, 1);
  safetensors::save(path("in.safetensors"), m);
  ASSERT_EQ(run("op kda_gate --lower-bound -5 --in " + path("in.safetensors") + " --out " +
                path("g.safetensors")),
            0);
  ops::KdaGateArgs a;
  a.z = m["z"], a.A_log = m["A_log"], a.dt_bias = m["dt_bias"];
  EXPECT_TRUE(
      testing::bit_equal(safetensors::load(path("g.safetensors")).tensors["g"], ops::kda_gate(a)));
  ASSERT_EQ(run("op kda_gate --in " + path("in.safetensors") + " --out " + path("g2.safetensors")),
            0);
  a.kind = ops::KdaGateKind::standard;
  EXPECT_TRUE(
      testing::bit_equal(safetensors::load(path("g2.safetensors")).tensors["g"], ops::kda_gate(a)));
  EXPECT_EQ(run("op kda_gate --lower-bound -6 --in " + path("in.safetensors") + " --out " +
                path("bad.safetensors")),
            2);
  EXPECT_FALSE(fs::exists(path("bad.safetensors")));
}

TEST_F(KdaCli, BadInputExits2) {
  Rng rng(testing::test_seed());
  auto m = make_inputs(DType::f32, rng);
  m["cu_seqlens"] = Tensor::from_vector<int64_t>({3}, {0, 70, 79});
  safetensors::save(path("in.safetensors"), m);
  EXPECT_EQ(run("op kda --in " + path("in.safetensors") + " --out " + path("o.safetensors")), 2);
  EXPECT_FALSE(fs::exists(path("o.safetensors")));
  m = make_inputs(DType::f32, rng);
  m.erase("beta");
  safetensors::save(path("in2.safetensors"), m);
  EXPECT_EQ(run("op kda --in " + path("in2.safetensors") + " --out " + path("o.safetensors")), 2);
  m = make_inputs(DType::f32, rng);
  m.erase("do");
  safetensors::save(path("in3.safetensors"), m);
  EXPECT_EQ(
      run("op kda --backward --in " + path("in3.safetensors") + " --out " + path("o.safetensors")),
      2);
  EXPECT_EQ(
      run("op kda --impl bogus --in " + path("in.safetensors") + " --out " + path("o.safetensors")),
      2);
  EXPECT_FALSE(fs::exists(path("o.safetensors")));
}

}  // namespace
}  // namespace hlm
