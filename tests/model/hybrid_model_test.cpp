// HybridModel: finite-difference gradients of the whole model (FP64, every parameter family and
// MTP), packed batch == sequences one by one (bit-identical hidden states), the three recompute
// modes give bit-identical gradients, save -> load gives identical outputs, tied embeddings, the
// HF parameter names, and bad input.
#include <filesystem>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "core/seq_layout.h"
#include "model/checkpoint.h"
#include "model/hybrid_model.h"
#include "testing.h"

namespace hlm {
namespace {

using testing::grad_check;
using testing::test_seed;

// A very small GLM-5.3-Flash-shaped hybrid: KDA, DSA with KPool, KDA; dense first layer, MoE
// after; mHC with 4 streams; one MTP depth.
nlohmann::json tiny_json() {
  return nlohmann::json::parse(R"({
    "model_type": "glm5_next_text", "vocab_size": 24, "hidden_size": 16,
    "num_hidden_layers": 3, "layer_pattern": "KDK", "first_k_dense_replace": 1,
    "intermediate_size": 24, "swiglu_limit": 10.0, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": false, "initializer_range": 0.2,
    "linear_num_heads": 2, "linear_head_dim": 8, "linear_conv_kernel_dim": 4,
    "linear_lower_bound": -5.0,
    "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 8, "kv_lora_rank": 8,
    "qk_nope_head_dim": 4, "qk_rope_head_dim": 0, "v_head_dim": 4,
    "index_n_heads": 2, "index_head_dim": 8, "index_topk": 6, "index_kpool": 2,
    "index_kpool_always_select_tail": true, "dsa_indexer_loss_coeff": 0.1,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "moe_intermediate_size": 8, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
    "norm_topk_prob": true, "router_aux_loss_coef": 0.01,
    "mhc": true, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "num_nextn_predict_layers": 1, "mtp_loss_scaling_factor": 0.3,
    "gemm_precision": "native"
  })");
}

ModelConfig tiny_config(bool tied = false) {
  nlohmann::json j = tiny_json();
  j["tie_word_embeddings"] = tied;
  return ModelConfig::from_json(j, "tiny test config");
}

struct Batch {
  Tensor tokens, targets, cu;
  std::vector<int64_t> lengths;
};

Batch random_batch(const std::vector<int64_t>& lengths, int64_t vocab, Rng& rng) {
  Batch b;
  b.lengths = lengths;
  int64_t T = 0;
  for (int64_t l : lengths) T += l;
  std::vector<int64_t> tok(static_cast<size_t>(T)), tgt(static_cast<size_t>(T), -100);
  for (auto& t : tok) t = int64_t(rng.next_u32() % uint32_t(vocab));
  int64_t p = 0;
  for (int64_t l : lengths) {
    for (int64_t i = 0; i + 1 < l; ++i) tgt[size_t(p + i)] = tok[size_t(p + i + 1)];
    p += l;
  }
  b.tokens = Tensor::from_vector({T}, tok);
  b.targets = Tensor::from_vector({T}, tgt);
  b.cu = SeqLayout::from_lengths(lengths).cu_seqlens();
  return b;
}

ModelInputs inputs_of(const Batch& b, bool aux) {
  ModelInputs in;
  in.tokens = b.tokens;
  in.targets = b.targets;
  in.cu_seqlens = b.cu;
  in.aux_losses = aux;
  return in;
}

TEST(HybridModel, ParameterNamesFollowTheHfCheckpoint) {
  HybridModel m(tiny_config(), {.dtype = DType::f32, .seed = 1});
  std::set<std::string> names;
  for (auto& [n, p] : m.named_parameters()) names.insert(n);
  for (const char* n : {"model.embed_tokens.weight",
                        "model.layers.0.attn_hc.fn",
                        "model.layers.0.ffn_hc.scale",
                        "model.layers.0.input_layernorm.weight",
                        "model.layers.0.self_attn.q_proj.weight",
                        "model.layers.0.self_attn.conv1d.weight",
                        "model.layers.0.self_attn.forget_gate.A_log",
                        "model.layers.0.self_attn.forget_gate.f_a_proj.weight",
                        "model.layers.0.self_attn.g_b_proj.weight",
                        "model.layers.0.self_attn.o_norm.weight",
                        "model.layers.0.mlp.gate_proj.weight",
                        "model.layers.1.self_attn.q_a_proj.weight",
                        "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
                        "model.layers.1.self_attn.indexer.wq_b.weight",
                        "model.layers.1.self_attn.indexer.index_kpool_compress_gate",
                        "model.layers.1.mlp.gate.weight",
                        "model.layers.1.mlp.gate.e_score_correction_bias",
                        "model.layers.1.mlp.experts.gate_up_proj",
                        "model.layers.2.mlp.shared_experts.up_proj.weight",
                        "model.norm.weight",
                        "lm_head.weight",
                        "model.layers.3.eh_proj.weight",
                        "model.layers.3.enorm.weight",
                        "model.layers.3.shared_head.norm.weight",
                        "model.layers.3.self_attn.indexer.wk.weight",
                        "model.layers.3.mlp.experts.down_proj"})
    EXPECT_TRUE(names.count(n)) << n;
  // keep-in-FP32 parameters survive a bf16 cast.
  m.to_dtype(DType::bf16);
  EXPECT_EQ(m.find_parameter("model.layers.0.attn_hc.fn")->value.dtype(), DType::f32);
  EXPECT_EQ(m.find_parameter("model.layers.0.self_attn.forget_gate.A_log")->value.dtype(),
            DType::f32);
  EXPECT_EQ(m.find_parameter("model.layers.0.self_attn.q_proj.weight")->value.dtype(), DType::bf16);
}

// d loss / d theta against central differences for a sample of every parameter tensor.
void check_model_gradients(bool tied) {
  HybridModel m(tiny_config(tied), {.dtype = DType::f64, .seed = test_seed()});
  Rng rng(test_seed());
  const Batch b = random_batch({13, 1, 9}, 24, rng);
  const ModelInputs in = inputs_of(b, /*aux=*/false);
  Context ctx;
  m.zero_grad();
  HybridModel::SavedPtr saved;
  const ModelOutput out = m.forward(ctx, in, &saved);
  EXPECT_GT(out.lm_count, 0);
  EXPECT_GT(out.mtp_count, 0);
  m.backward(ctx, *saved);
  Context eval;
  eval.training = false;
  auto loss = [&] { return m.forward(eval, in).loss; };
  int checked = 0;
  for (auto& [name, p] : m.named_parameters()) {
    if (name.find("indexer") != std::string::npos ||
        name.find("e_score_correction_bias") != std::string::npos)
      continue;  // trained by the indexer loss (off here) / not trained by gradients
    EXPECT_TRUE(grad_check(loss, p->value, p->grad, 1e-6, 2e-6, 6)) << name;
    ++checked;
  }
  EXPECT_GT(checked, 60);
}

TEST(HybridModel, GradientsMatchFiniteDifferences) {
  check_model_gradients(false);
}

TEST(HybridModel, TiedEmbeddingGradientsMatchFiniteDifferences) {
  check_model_gradients(true);
}

TEST(HybridModel, AuxAndIndexerLossesReachTheirParameters) {
  HybridModel m(tiny_config(), {.dtype = DType::f64, .seed = test_seed()});
  Rng rng(test_seed());
  const Batch b = random_batch({20, 11}, 24, rng);
  Context ctx;
  m.zero_grad();
  HybridModel::SavedPtr saved;
  const ModelOutput out = m.forward(ctx, inputs_of(b, true), &saved);
  EXPECT_GT(out.aux_loss, 0);
  EXPECT_GT(out.indexer_loss, 0);
  EXPECT_NEAR(out.loss, out.lm_loss + 0.3 * out.mtp_loss + out.aux_loss + out.indexer_loss, 1e-12);
  m.backward(ctx, *saved);
  for (const char* n : {"model.layers.1.self_attn.indexer.wq_b.weight",
                        "model.layers.3.self_attn.indexer.wk.weight"}) {
    const auto g = m.find_parameter(n)->grad.to_f64_vector();
    double s = 0;
    for (double v : g) s += std::fabs(v);
    EXPECT_GT(s, 0) << n;
  }
  EXPECT_EQ(out.expert_counts.size(), 3u);  // layers 1, 2 and MTP
}

TEST(HybridModel, PackedBatchEqualsSequencesOneByOne) {
  for (DType dt : {DType::f32, DType::f64}) {
    HybridModel m(tiny_config(), {.dtype = dt, .seed = 7});
    Rng rng(test_seed());
    const Batch b = random_batch({17, 1, 30, 5}, 24, rng);
    Context eval;
    eval.training = false;
    ModelInputs in = inputs_of(b, true);
    const ModelOutput packed = m.forward(eval, in);
    int64_t p = 0;
    for (int64_t l : b.lengths) {
      ModelInputs one;
      one.tokens = b.tokens.slice(0, p, p + l).contiguous();
      one.targets = b.targets.slice(0, p, p + l).contiguous();
      const ModelOutput o = m.forward(eval, one);
      EXPECT_TRUE(testing::bit_equal(o.hidden, packed.hidden.slice(0, p, p + l).contiguous()))
          << dtype_name(dt) << " sequence at " << p;
      EXPECT_TRUE(testing::bit_equal(o.logits, packed.logits.slice(0, p, p + l).contiguous()));
      EXPECT_TRUE(
          testing::bit_equal(o.mtp_logits, packed.mtp_logits.slice(0, p, p + l).contiguous()));
      p += l;
    }
  }
}

// Data parallelism's decomposition (train/data_parallel.h): parts of a batch (whole sequences)
// run with the whole batch's loss denominators and indexer-row factors give losses that sum to
// the whole batch's and gradients that sum to its gradients (FP64, every loss term: main and MTP
// cross-entropy, MoE sequence aux loss, DSA indexer KL).
TEST(HybridModel, PartsWithTheWholeBatchsNormalizersSumToTheWholeBatch) {
  HybridModel m(tiny_config(), {.dtype = DType::f64, .seed = test_seed()});
  Rng rng(test_seed());
  const std::vector<int64_t> lengths{20, 11, 7, 15, 1};
  const Batch whole = random_batch(lengths, 24, rng);
  Context ctx;
  m.zero_grad();
  HybridModel::SavedPtr saved;
  const ModelOutput ref = m.forward(ctx, inputs_of(whole, true), &saved);
  m.backward(ctx, *saved);
  saved.reset();
  ASSERT_GT(ref.aux_loss, 0);
  ASSERT_GT(ref.indexer_loss, 0);
  ASSERT_EQ(ref.indexer_rows.size(), 2u);  // the DSA layer and the MTP block's
  std::map<std::string, Tensor> want;
  for (auto& [n, p] : m.named_parameters()) want[n] = p->grad.clone();

  for (const std::vector<size_t>& cut : {std::vector<size_t>{2}, std::vector<size_t>{1, 3, 4}}) {
    SCOPED_TRACE(cut.size() + 1);
    // The parts' batches: sequences [cut[i-1], cut[i]).
    std::vector<Batch> parts;
    size_t q0 = 0;
    int64_t t0 = 0;
    for (size_t i = 0; i <= cut.size(); ++i) {
      const size_t q1 = i < cut.size() ? cut[i] : lengths.size();
      const std::vector<int64_t> len(lengths.begin() + ptrdiff_t(q0),
                                     lengths.begin() + ptrdiff_t(q1));
      Batch b;
      b.lengths = len;
      b.tokens = whole.tokens.slice(0, t0, t0 + testing::total(len)).clone();
      b.targets = whole.targets.slice(0, t0, t0 + testing::total(len)).clone();
      b.cu = testing::cu_of(len);
      parts.push_back(b);
      t0 += testing::total(len);
      q0 = q1;
    }
    m.zero_grad();
    std::vector<ModelOutput> outs;
    std::vector<HybridModel::SavedPtr> saves(parts.size());
    for (size_t i = 0; i < parts.size(); ++i) {
      ModelInputs in = inputs_of(parts[i], true);
      in.lm_normalizer = ref.lm_count;
      in.mtp_normalizer = ref.mtp_count;
      in.aux_sequences = int64_t(lengths.size());
      outs.push_back(m.forward(ctx, in, &saves[i]));
    }
    std::vector<int64_t> rows(ref.indexer_rows.size(), 0);
    for (const auto& o : outs)
      for (size_t l = 0; l < rows.size(); ++l) rows[l] += o.indexer_rows[l];
    EXPECT_EQ(rows, ref.indexer_rows);
    double lm = 0, mtp = 0, aux = 0, indexer = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      std::vector<double> scales;
      for (size_t l = 0; l < rows.size(); ++l) {
        scales.push_back(double(outs[i].indexer_rows[l]) / double(rows[l]));
        indexer += outs[i].indexer_losses[l] * scales[l];
      }
      lm += outs[i].lm_loss;
      mtp += outs[i].mtp_loss;
      aux += outs[i].aux_loss;
      m.backward(ctx, *saves[i], {}, scales);
    }
    EXPECT_NEAR(lm, ref.lm_loss, 1e-12 * ref.lm_loss);
    EXPECT_NEAR(mtp, ref.mtp_loss, 1e-12 * ref.mtp_loss);
    EXPECT_NEAR(aux, ref.aux_loss, 1e-12 * ref.aux_loss);
    EXPECT_NEAR(indexer, ref.indexer_loss, 1e-12 * ref.indexer_loss);
    for (auto& [n, p] : m.named_parameters())
      EXPECT_TRUE(testing::close(p->grad, want.at(n), {1e-11, 1e-12})) << n;
  }
  // A normalizer below the part's own count is refused.
  ModelInputs bad = inputs_of(whole, true);
  bad.lm_normalizer = 3;
  testing::expect_error([&] { m.forward(ctx, bad); }, "lm_normalizer 3 is below");
}

TEST(HybridModel, RecomputeModesGiveBitIdenticalGradients) {
  Rng rng(test_seed());
  const Batch b = random_batch({25, 14}, 24, rng);
  std::vector<std::vector<std::pair<std::string, Tensor>>> grads;
  for (Recompute r : {Recompute::none, Recompute::selective, Recompute::full}) {
    HybridModel m(tiny_config(), {.dtype = DType::f32, .seed = 3, .recompute = r});
    Context ctx;
    m.zero_grad();
    HybridModel::SavedPtr saved;
    m.forward(ctx, inputs_of(b, true), &saved);
    m.backward(ctx, *saved);
    grads.emplace_back();
    for (auto& [n, p] : m.named_parameters()) grads.back().emplace_back(n, p->grad.clone());
  }
  for (size_t r = 1; r < grads.size(); ++r)
    for (size_t i = 0; i < grads[0].size(); ++i)
      EXPECT_TRUE(testing::bit_equal(grads[r][i].second, grads[0][i].second))
          << recompute_name(Recompute(r)) << " " << grads[0][i].first;
}

TEST(HybridModel, SaveLoadGivesIdenticalOutputs) {
  const ModelConfig cfg = tiny_config();
  HybridModel a(cfg, {.dtype = DType::f32, .seed = 11});
  HybridModel b(cfg, {.dtype = DType::f32, .seed = 12});
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("hlm_model_" + std::to_string(test_seed())))
          .string();
  checkpoint::save_module(dir, a, &cfg);
  checkpoint::load_module(dir, b);
  const ModelConfig back = ModelConfig::load(dir);
  EXPECT_TRUE(back == cfg);
  Rng rng(test_seed());
  const Batch batch = random_batch({12, 9}, 24, rng);
  Context eval;
  eval.training = false;
  const ModelOutput oa = a.forward(eval, inputs_of(batch, true));
  const ModelOutput ob = b.forward(eval, inputs_of(batch, true));
  EXPECT_TRUE(testing::bit_equal(oa.hidden, ob.hidden));
  EXPECT_TRUE(testing::bit_equal(oa.logits, ob.logits));
  EXPECT_EQ(oa.loss, ob.loss);
  std::filesystem::remove_all(dir);
}

TEST(HybridModel, OutputProcessorReplacesTheHead) {
  HybridModel m(tiny_config(), {.dtype = DType::f64, .seed = 5, .mtp = false});
  Rng rng(test_seed());
  const Batch b = random_batch({10}, 24, rng);
  Tensor probe = randn({10, 16}, DType::f64, rng);
  ModelInputs in;
  in.tokens = b.tokens;
  in.aux_losses = false;
  in.output_processor = [&](const Tensor& h, Tensor* dh) {
    dh->copy_(probe);
    return testing::dot(h, probe);
  };
  Context ctx;
  m.zero_grad();
  HybridModel::SavedPtr saved;
  const ModelOutput out = m.forward(ctx, in, &saved);
  EXPECT_FALSE(out.logits.defined());
  m.backward(ctx, *saved);
  // The same gradients as the grad-probe path of the parity tool.
  std::vector<Tensor> g1;
  for (auto& [n, p] : m.named_parameters()) g1.push_back(p->grad.clone());
  m.zero_grad();
  ModelInputs plain;
  plain.tokens = b.tokens;
  plain.aux_losses = false;
  HybridModel::SavedPtr s2;
  m.forward(ctx, plain, &s2);
  m.backward(ctx, *s2, probe);
  size_t i = 0;
  for (auto& [n, p] : m.named_parameters()) EXPECT_TRUE(testing::bit_equal(p->grad, g1[i++])) << n;
  EXPECT_NEAR(out.lm_loss, testing::dot(out.hidden, probe), 1e-12);
}

// Replaying the model's own DSA selections reproduces it bit for bit; a "shared" DSA layer attends
// the previous DSA layer's sets; a non-causal given index is refused.
TEST(HybridModel, DsaSelectionReplayAndSharedIndexers) {
  Rng rng(test_seed());
  const Batch b = random_batch({30, 19}, 24, rng);
  Context eval;
  eval.training = false;
  {
    HybridModel m(tiny_config(), {.dtype = DType::f32, .seed = 9});
    const ModelOutput own = m.forward(eval, inputs_of(b, true));
    ASSERT_EQ(own.dsa_indices.size(), 1u);
    ModelInputs in = inputs_of(b, true);
    in.dsa_indices = own.dsa_indices;
    const ModelOutput again = m.forward(eval, in);
    EXPECT_TRUE(testing::bit_equal(again.hidden, own.hidden));
    Tensor bad = own.dsa_indices[0].to(DType::i64);
    bad.data<int64_t>()[0] = 5;  // query 0 cannot attend token 5
    in.dsa_indices = {bad};
    EXPECT_THROW(m.forward(eval, in), Error);
    // Only -1 is padding: -2^32 was skipped as padding, then wrapped to token 0 in the i32 copy.
    bad = own.dsa_indices[0].to(DType::i64);
    bad.data<int64_t>()[bad.size(1) * 3] = -(int64_t(1) << 32);
    in.dsa_indices = {bad};
    try {
      m.forward(eval, in);
      FAIL() << "-2^32 accepted as padding";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("= -4294967296 is neither -1 (padding)"),
                std::string::npos)
          << e.what();
    }
  }
  nlohmann::json j = tiny_json();
  j["layer_pattern"] = "KDD";
  j["indexer_types"] = {"full", "full", "shared"};
  const ModelConfig cfg = ModelConfig::from_json(j, "shared indexer config");
  HybridModel m(cfg, {.dtype = DType::f32, .seed = 4});
  EXPECT_EQ(m.find_parameter("model.layers.2.self_attn.indexer.wq_b.weight"), nullptr);
  const ModelOutput out = m.forward(eval, inputs_of(b, true));
  ASSERT_EQ(out.dsa_indices.size(), 2u);
  EXPECT_TRUE(testing::bit_equal(out.dsa_indices[1], out.dsa_indices[0]));
}

TEST(HybridModel, BadInputIsAClearError) {
  HybridModel m(tiny_config(), {.dtype = DType::f32, .seed = 1});
  Context eval;
  eval.training = false;
  ModelInputs in;
  in.tokens = Tensor::from_vector<int64_t>({3}, {1, 2, 99});
  try {
    m.forward(eval, in);
    FAIL() << "out-of-vocabulary id accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("99"), std::string::npos) << e.what();
  }
  in.tokens = Tensor::from_vector<int64_t>({3}, {1, 2, 3});
  in.cu_seqlens = Tensor::from_vector<int64_t>({2}, {0, 2});
  EXPECT_THROW(m.forward(eval, in), Error);
  in.cu_seqlens = Tensor();
  in.targets = Tensor::from_vector<int64_t>({2}, {1, 2});
  EXPECT_THROW(m.forward(eval, in), Error);
  in.targets = Tensor();
  // Float ids were truncated (5.7 -> 5), float or u8 cu_seqlens converted: integers only.
  in.tokens = Tensor::from_values({3}, {1, 5.7, 2}, DType::f32);
  EXPECT_THROW(m.forward(eval, in), Error);
  in.tokens = Tensor::from_vector<int64_t>({3}, {1, 2, 3});
  for (DType dt : {DType::f32, DType::u8}) {
    in.cu_seqlens = Tensor::from_values({2}, {0, 3}, dt);
    EXPECT_THROW(m.forward(eval, in), Error) << dtype_name(dt);
  }
  in.cu_seqlens = Tensor::from_values({3}, {0, 1, 3}, DType::i32);
  EXPECT_NO_THROW(m.forward(eval, in));
}

}  // namespace
}  // namespace hlm
