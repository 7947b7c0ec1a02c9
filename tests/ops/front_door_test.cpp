// The front doors of the ops (ops/<op>.cpp) allocate every output with detail::new_output, which
// fills it with NaN (0xFF bytes) while the test hook ops::set_poison_outputs is on. Each op here
// runs twice on the same random inputs, hook off and hook on, and must give the same bits: an
// output element that a CPU reference leaves unwritten (or reads before writing) shows up as a
// NaN or a changed value. Accumulated gradients start from the same values in both runs.
#include <functional>
#include <vector>

#include "core/rng.h"
#include "core/seq_layout.h"
#include "ops/activations.h"
#include "ops/cast.h"
#include "ops/conv1d.h"
#include "ops/cross_entropy.h"
#include "ops/dispatch.h"
#include "ops/dsa_indexer.h"
#include "ops/dsa_indexer_loss.h"
#include "ops/dsa_kpool.h"
#include "ops/dsa_sparse_attention.h"
#include "ops/embedding.h"
#include "ops/fp8_quant.h"
#include "ops/gemm.h"
#include "ops/kda_decode.h"
#include "ops/kda_gate.h"
#include "ops/l2norm.h"
#include "ops/layernorm.h"
#include "ops/mhc.h"
#include "ops/moe.h"
#include "ops/rmsnorm.h"
#include "ops/softmax.h"
#include "ops/tensor_ops.h"
#include "testing.h"

namespace hlm::ops {
namespace {

using hlm::testing::test_seed;
using Outs = std::vector<Tensor>;

using PoisonOn = hlm::testing::PoisonOutputs;

// Runs `run` with the hook off, then on; every output must have the same bits.
void expect_poison_invariant(const char* what, const std::function<Outs()>& run) {
  set_poison_outputs(false);
  const Outs plain = run();
  Outs poisoned;
  {
    PoisonOn on;
    poisoned = run();
  }
  ASSERT_EQ(plain.size(), poisoned.size()) << what;
  for (size_t i = 0; i < plain.size(); ++i)
    EXPECT_TRUE(hlm::testing::bit_equal(poisoned[i], plain[i])) << what << ": output " << i;
}

TEST(FrontDoorPoison, TheHookPoisonsNewOutputs) {
  PoisonOn on;
  const Tensor t = detail::new_output({3}, DType::f32, Device::cpu);
  for (double v : t.to_f64_vector()) EXPECT_TRUE(std::isnan(v));
  const Tensor i = detail::new_output({2}, DType::i64, Device::cpu);
  for (double v : i.to_f64_vector()) EXPECT_EQ(v, -1.0);
}

TEST(FrontDoorPoison, ElementwiseNormsConvGateDecode) {
  Rng rng(test_seed());
  for (DType dt : {DType::f32, DType::f64}) {
    const Tensor x = randn({7, 5}, dt, rng), dy = randn({7, 5}, dt, rng);
    expect_poison_invariant("activations", [&] {
      return Outs{sigmoid_forward(x),   sigmoid_backward(x, dy), silu_forward(x),
                  silu_backward(x, dy), softplus_forward(x),     softplus_backward(x, dy)};
    });
    const Tensor w = randn({5}, dt, rng), gate = randn({7, 5}, dt, rng), dw0 = randn({5}, dt, rng);
    expect_poison_invariant("norms", [&] {
      const RmsNormResult r = rmsnorm_forward(x, w);
      const RmsNormResult g = gated_rmsnorm_forward(x, gate, w);
      const L2NormResult l = l2norm_forward(x);
      Tensor dw1 = dw0.clone(), dw2 = dw0.clone();
      const Tensor dx = rmsnorm_backward(dy, x, w, r.rstd, dw1);
      const GatedRmsNormGrads gg = gated_rmsnorm_backward(dy, x, gate, w, g.rstd, dw2);
      return Outs{r.y,
                  r.rstd,
                  g.y,
                  dx,
                  gg.dx,
                  gg.dgate,
                  dw1,
                  dw2,
                  l.y,
                  l.rstd,
                  l2norm_backward(dy, x, l.rstd)};
    });
    // Three sequences, one shorter than the conv's W - 1 = 3, with an initial state.
    const SeqLayout cu = hlm::testing::seqs_of({4, 2, 1});
    const Tensor cw = randn({5, 4}, dt, rng);
    const Tensor st = randn({3, 3, 5}, dt, rng), cdw0 = randn({5, 4}, dt, rng);
    const Tensor xu = randn({3, 5}, dt, rng);
    expect_poison_invariant("conv1d", [&] {
      Tensor fin, cdw = cdw0.clone(), state = st.clone();
      const Tensor y = causal_conv1d_forward(x, cw, cu, st, true, &fin);
      const CausalConv1dGrads g = causal_conv1d_backward(dy, x, cw, cu, st, true, cdw);
      const Tensor yu = causal_conv1d_update(xu, state, cw, true);
      return Outs{y, fin, g.dx, g.dinitial_state, cdw, state, yu};
    });
  }
  for (KdaGateKind kind : {KdaGateKind::standard, KdaGateKind::lower_bound}) {
    KdaGateArgs a;
    a.z = randn({6, 2, 4}, DType::f32, rng);
    a.A_log = randn({2}, DType::f32, rng, 0.5);
    a.dt_bias = randn({8}, DType::f32, rng);
    a.kind = kind;
    const Tensor dg = randn({6, 2, 4}, DType::f32, rng);
    expect_poison_invariant("kda_gate", [&] {
      const KdaGateGrads g = kda_gate_backward(a, dg);
      return Outs{kda_gate(a), g.dz, g.dA_log, g.ddt_bias};
    });
  }
  // A pool of 5 states for 3 sequences, one skipped (its o rows are zero).
  KdaDecodeArgs d;
  d.q = randn({3, 2, 8}, DType::f32, rng);
  d.k = randn({3, 2, 8}, DType::f32, rng);
  d.v = randn({3, 4, 6}, DType::f32, rng);
  d.g = rand_uniform({3, 4, 8}, DType::f32, rng, -1, 0);
  d.beta = rand_uniform({3, 4}, DType::f32, rng, 0, 1);
  d.state_indices = Tensor::from_vector<int64_t>({3}, {4, -1, 1});
  d.use_qk_l2norm = true;
  const Tensor s0 = randn({5, 4, 8, 6}, DType::f32, rng);
  expect_poison_invariant("kda_decode_step", [&] {
    KdaDecodeArgs a = d;
    a.state = s0.clone();
    const Tensor o = kda_decode_step(a);
    return Outs{o, a.state};
  });
}

TEST(FrontDoorPoison, CastGemmTensorOps) {
  Rng rng(test_seed());
  const Tensor x = randn({6, 9}, DType::f32, rng, 100.0), b = randn({9, 4}, DType::f64, rng);
  expect_poison_invariant("cast / matmul / tensor_ops", [&] {
    const Tensor xd = as_dtype(x, DType::f64);
    return Outs{cast(x, DType::bf16),
                cast(x, DType::e4m3, Saturate::none),
                matmul(xd, false, b, false),
                matmul(x, false, b, false, GemmOptions{true}),
                xd,
                contiguous(xd.transpose(0, 1)),
                sum_rows(x, DType::f64)};
  });
}

TEST(FrontDoorPoison, SoftmaxLayerNormCrossEntropyEmbedding) {
  Rng rng(test_seed());
  for (DType dt : {DType::f32, DType::f64}) {
    const Tensor x = randn({2, 3, 7}, dt, rng), dy = randn({2, 3, 7}, dt, rng);
    const Tensor w = randn({7}, dt, rng), b = randn({7}, dt, rng), acc0 = randn({7}, dt, rng);
    const Tensor logits = randn({5, 7}, dt, rng);
    const Tensor targets = Tensor::from_vector<int64_t>({5}, {3, -100, 0, 6, 2});
    const Tensor table = randn({7, 4}, dt, rng),
                 ids = Tensor::from_vector<int32_t>({2, 2}, {1, 6, 1, 0});
    const Tensor demb = randn({2, 2, 4}, dt, rng);
    expect_poison_invariant("softmax / layernorm / cross_entropy / embedding", [&] {
      const Tensor y = softmax_forward(x);
      const LayerNormResult ln = layernorm_forward(x, w, b);
      Tensor dw = acc0.clone(), db = acc0.clone(), dtab = table.clone();
      const Tensor dx = layernorm_backward(dy, x, w, ln.mean, ln.rstd, dw, db);
      const CrossEntropyResult ce = cross_entropy_forward(logits, targets);
      embedding_backward(demb, ids, dtab);
      return Outs{y,
                  softmax_backward(y, dy),
                  ln.y,
                  ln.mean,
                  ln.rstd,
                  dx,
                  dw,
                  db,
                  ce.row_loss,
                  ce.lse,
                  cross_entropy_backward(logits, targets, ce, 0.5),
                  embedding_forward(table, ids),
                  dtab};
    });
  }
}

TEST(FrontDoorPoison, Fp8) {
  Rng rng(test_seed());
  const Tensor x = randn({130, 256}, DType::f32, rng), wt = randn({200, 256}, DType::f64, rng);
  expect_poison_invariant("fp8", [&] {
    const Fp8Tensor a = fp8_quantize(x, {Fp8Format::e4m3, TileShape::t1x128, false});
    const Fp8Tensor w = fp8_quantize(wt, {Fp8Format::e5m2, TileShape::t128x128, true});
    const Fp8Tensor t = fp8_transpose_blocks(w);
    return Outs{a.q,         a.scale_inv,       w.q,           w.scale_inv,      t.q,
                t.scale_inv, fp8_dequantize(a), fp8_values(w), fp8_gemm_tn(a, w)};
  });
}

TEST(FrontDoorPoison, DsaIndexerAttentionKPool) {
  Rng rng(test_seed());
  const std::vector<int64_t> lens{7, 2, 5};
  const SeqLayout cu = hlm::testing::seqs_of(lens);
  const int64_t T = 14, H = 2, D = 8, P = 2;
  for (DType dt : {DType::f32, DType::f64}) {
    const Tensor q = randn({T, H, D}, dt, rng), k = randn({T, D}, dt, rng),
                 wts = randn({T, H}, dt, rng);
    const Tensor qa = randn({T, 3, D}, dt, rng), kv = randn({T, D}, dt, rng);
    const Tensor gate = randn({T, D}, dt, rng), ape = randn({P, D}, dt, rng);
    IndexerScoreOptions o8;
    o8.fp8 = true;
    IndexerScoreOptions pooled;
    pooled.pool = P;
    // Gradient inputs of the shapes the forward ops give (scores [T, 9], selection [T, 3], pooled
    // keys [NP = 3 + 1 + 2, D], selection with the tail [T, 4 + 1]).
    const Tensor dsc = randn({T, 9}, dt, rng), dsel = randn({T, 3}, dt, rng),
                 dout = randn({T, 3, 6}, dt, rng), dpk = randn({6, D}, dt, rng),
                 tt = randn({T, 5}, dt, rng);
    expect_poison_invariant("dsa", [&] {
      const Tensor sc = indexer_scores(q, k, wts, cu, {}, 9);
      const Tensor sel = topk_select(sc, cu, 3);
      const Tensor sc_at = indexer_scores_at(q, k, wts, cu, sel, o8);
      const IndexerScoreGrads g = indexer_scores_backward(q, k, wts, cu, dsc);
      const IndexerScoreGrads ga = indexer_scores_at_backward(q, k, wts, cu, sel, dsel, o8);
      const SparseAttentionOut at = sparse_attention(qa, kv, sel, cu, 6, 0.3);
      const SparseAttentionGrads ag =
          sparse_attention_backward(qa, kv, sel, cu, 6, 0.3, at.out, at.lse, dout);
      const Tensor tgt = attention_target(qa, kv, cu, 0.3, 9);
      const Tensor tgt_at = attention_target_at(qa, kv, cu, sel, 0.3);
      const IndexerKl kl = indexer_kl_loss(sc, tgt, 0.7);
      const Tensor pk = kpool_compress(k, gate, ape, cu);
      const KPoolCompressGrads kg = kpool_compress_backward(k, gate, ape, cu, dpk);
      const Tensor psc = indexer_scores(q, pk, wts, cu, pooled);
      const KPoolSelection ks = kpool_select(psc, cu, 4, P);
      const Tensor ptd = kpool_pool_target_dense(tgt, cu, P);
      const Tensor pts = kpool_pool_target_sparse(tt, ks.pools, P);
      return Outs{sc,       sel,     sc_at, g.dq,       g.dk,     g.dw,   ga.dq,       ga.dk, ga.dw,
                  at.out,   at.lse,  ag.dq, ag.dkv,     tgt,      tgt_at, kl.d_scores, pk,    kg.dk,
                  kg.dgate, kg.dape, psc,   ks.indices, ks.pools, ptd,    pts};
    });
  }
}

TEST(FrontDoorPoison, MoeAndMhc) {
  Rng rng(test_seed());
  for (DType dt : {DType::f32, DType::f64}) {
    const int64_t T = 6, E = 8, D = 5, I = 3;
    MoeRouterConfig cfg;
    cfg.n_experts = E;
    cfg.top_k = 2;
    cfg.n_group = 4;
    cfg.topk_group = 2;
    const Tensor logits = randn({T, E}, dt, rng), bias = randn({E}, dt, rng, 0.1);
    const Tensor x = randn({T, D}, dt, rng), dout = randn({T, D}, dt, rng);
    const MoeWeights w{randn({E, 2 * I, D}, dt, rng), randn({E, D, I}, dt, rng),
                       randn({4, D}, dt, rng), randn({D, 2}, dt, rng)};
    const Tensor gu = randn({T, 2 * I}, dt, rng, 8.0), dh = randn({T, I}, dt, rng);
    const SeqLayout cu = hlm::testing::seqs_of({4, 2});
    const Tensor dweight = randn({T, 2}, dt, rng);
    expect_poison_invariant("moe", [&] {
      const MoeRouterResult r = moe_router_forward(logits, bias, cfg);
      const Tensor dl = moe_router_backward(logits, r, cfg, dweight);
      MoeSaved s;
      const Tensor out = moe_experts_forward(x, w, r.topk_idx, r.topk_weight, 7.0, s);
      MoeWeightGrads g{Tensor::zeros(w.gate_up.shape(), dt), Tensor::zeros(w.down.shape(), dt),
                       Tensor::zeros(w.shared_gate_up.shape(), dt),
                       Tensor::zeros(w.shared_down.shape(), dt)};
      const MoeGrads mg = moe_experts_backward(s, w, dout, g);
      return Outs{r.scores,
                  r.topk_idx,
                  r.topk_weight,
                  dl,
                  moe_expert_load(r.topk_idx, E),
                  moe_seq_aux_loss_backward(logits, r.topk_idx, cu, 0.01),
                  swiglu_clamped_forward(gu, 7.0),
                  swiglu_clamped_backward(gu, dh, 7.0),
                  out,
                  s.gu,
                  s.h,
                  s.eo,
                  mg.dx,
                  mg.dtopk_weight,
                  g.dgate_up,
                  g.ddown,
                  g.dshared_gate_up,
                  g.dshared_down};
    });
    MhcConfig c;
    c.n = 3;
    c.sinkhorn_iters = 4;
    const Tensor xs = randn({T, 3, D}, dt, rng), y = randn({T, D}, dt, rng);
    const Tensor dxo = randn({T, 3, D}, dt, rng), du = randn({T, D}, dt, rng);
    const Tensor dir = randn({T}, dt, rng), dcomb = randn({T, 3, 3}, dt, rng);
    const MhcParams p{randn({c.n_mix(), 3 * D}, dt, rng, 0.2), randn({c.n_mix()}, dt, rng),
                      randn({3}, dt, rng)};
    expect_poison_invariant("mhc", [&] {
      MhcSiteSaved s;
      const Tensor u = mhc_site_begin(xs, p, c, s);
      const Tensor xo = mhc_site_end(s, y);
      MhcParamGrads g{Tensor::zeros(p.fn.shape(), dt), Tensor::zeros(p.base.shape(), dt),
                      Tensor::zeros(p.scale.shape(), dt)};
      const Tensor dy = mhc_site_backward_dy(s, dxo);
      const Tensor dx = mhc_site_backward(s, dxo, du, g);
      const Tensor ir = mhc_inv_rms(xs, 1e-5);
      const MhcWriteBackGrads wb = mhc_write_back_backward(xs, y, s.maps.post, s.maps.comb, dxo);
      const MhcCollapseGrads cl = mhc_collapse_backward(xs, s.maps.pre, du);
      return Outs{u,
                  xo,
                  s.maps.inv_rms,
                  s.maps.mix,
                  s.maps.pre,
                  s.maps.post,
                  s.maps.comb_logits,
                  s.maps.comb,
                  dy,
                  dx,
                  g.dfn,
                  g.dbase,
                  g.dscale,
                  ir,
                  mhc_inv_rms_backward(xs, ir, dir),
                  mhc_sinkhorn(s.maps.comb_logits, 1e-6, 3),
                  mhc_sinkhorn_backward(s.maps.comb_logits, dcomb, 1e-6, 3),
                  wb.dx,
                  wb.dy,
                  wb.dpost,
                  wb.dcomb,
                  cl.dx,
                  cl.dpre,
                  mhc_expand(y, 3),
                  mhc_expand_backward(dxo),
                  mhc_mean_contract(xs),
                  mhc_mean_contract_backward(y, 3)};
    });
  }
}

}  // namespace
}  // namespace hlm::ops
