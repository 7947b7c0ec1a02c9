#include "train/data.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <set>

#include "testing.h"

namespace hlm::train {
namespace {

std::vector<int64_t> ints(const Tensor& t) {
  std::vector<int64_t> v;
  for (double x : t.to_f64_vector()) v.push_back(int64_t(x));
  return v;
}

bool batches_equal(const Batch& a, const Batch& b) {
  return testing::bit_equal(a.tokens, b.tokens) && testing::bit_equal(a.targets, b.targets) &&
         testing::bit_equal(a.loss_mask, b.loss_mask) &&
         testing::bit_equal(a.cu_seqlens, b.cu_seqlens) &&
         a.eval_positions.numel() == b.eval_positions.numel() &&
         (a.eval_positions.numel() == 0 || testing::bit_equal(a.eval_positions, b.eval_positions));
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& b) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
}

void write_u32(const std::string& path, const std::vector<uint32_t>& ids) {
  std::vector<uint8_t> b;
  for (uint32_t x : ids)
    for (int k = 0; k < 4; ++k) b.push_back(uint8_t(x >> (8 * k)));
  write_bytes(path, b);
}

// ---- packer ------------------------------------------------------------------------------------

TEST(DataPacker, PacksEndToEndAndCutsAtTheBudget) {
  Rng rng(testing::test_seed());
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t budget = 1 + int64_t(rng.below(64));
    Packer pk(budget);
    std::vector<Document> docs;
    std::vector<int64_t> taken;
    while (!pk.full()) {
      const int64_t L = int64_t(rng.below(40));  // includes empty and longer-than-budget documents
      std::vector<int64_t> toks(static_cast<size_t>(L));
      for (auto& t : toks) t = int64_t(rng.below(50));
      Document d = lm_document(toks);
      for (int64_t i = 0; i + 1 < L; i += 3) d.eval_positions.push_back(i);
      const int64_t before = pk.remaining();
      const int64_t n = pk.add(d);
      EXPECT_EQ(n, std::min(L, before));
      docs.push_back(d);
      taken.push_back(n);
    }
    const int64_t nonempty =
        std::count_if(taken.begin(), taken.end(), [](int64_t n) { return n > 0; });
    EXPECT_EQ(pk.num_sequences(), nonempty);
    Batch b = pk.finish();
    EXPECT_EQ(pk.size(), 0);  // reset
    check_batch(b, 50);
    ASSERT_EQ(b.num_tokens(), budget);
    EXPECT_EQ(b.num_sequences(), nonempty);
    const auto tok = ints(b.tokens), tgt = ints(b.targets), cu = ints(b.cu_seqlens),
               ev = ints(b.eval_positions);
    // Sequence j is the head of the j-th non-empty document, with the document's own targets.
    size_t seq = 0, evi = 0;
    for (size_t d = 0; d < docs.size(); ++d) {
      if (taken[d] == 0) continue;
      ASSERT_EQ(cu[seq + 1] - cu[seq], taken[d]);
      for (int64_t i = 0; i < taken[d]; ++i) {
        EXPECT_EQ(tok[size_t(cu[seq] + i)], docs[d].tokens[size_t(i)]);
        EXPECT_EQ(tgt[size_t(cu[seq] + i)], docs[d].targets[size_t(i)]);
      }
      for (int64_t p : docs[d].eval_positions)
        if (p < taken[d]) EXPECT_EQ(ev[evi++], cu[seq] + p);
      ++seq;
    }
    EXPECT_EQ(evi, ev.size());
    // A document's last position takes no loss; a cut keeps the true next token as the target.
    const size_t last = docs.size() - 1;
    if (taken[last] < docs[last].size())
      EXPECT_EQ(tgt.back(), docs[last].tokens[size_t(taken[last])]);
    else
      EXPECT_EQ(tgt.back(), kIgnoreIndex);
  }
}

TEST(DataPacker, ContinuesACutDocumentAndValidates) {
  Document d = lm_document({5, 6, 7, 8, 9, 10, 11});
  d.eval_positions = {1, 5};
  Packer a(4);
  EXPECT_EQ(a.add(d), 4);
  EXPECT_EQ(a.add(d), 0);  // full: nothing, and no empty sequence
  Batch b1 = a.finish();
  EXPECT_EQ(ints(b1.cu_seqlens), (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(ints(b1.targets), (std::vector<int64_t>{6, 7, 8, 9}));
  EXPECT_EQ(ints(b1.eval_positions), (std::vector<int64_t>{1}));
  Packer b(10);
  EXPECT_EQ(b.add(d, 4), 3);
  EXPECT_EQ(b.add(lm_document({1, 2})), 2);
  Batch b2 = b.finish();
  EXPECT_EQ(ints(b2.tokens), (std::vector<int64_t>{9, 10, 11, 1, 2}));
  EXPECT_EQ(ints(b2.targets), (std::vector<int64_t>{10, 11, kIgnoreIndex, 2, kIgnoreIndex}));
  EXPECT_EQ(ints(b2.loss_mask), (std::vector<int64_t>{1, 1, 0, 1, 0}));
  EXPECT_EQ(ints(b2.cu_seqlens), (std::vector<int64_t>{0, 3, 5}));
  EXPECT_EQ(ints(b2.eval_positions), (std::vector<int64_t>{1}));
  EXPECT_EQ(b2.num_loss_tokens(), 3);
  Document bad = d;
  bad.targets.pop_back();
  EXPECT_THROW(Packer(4).add(bad), Error);
  bad = d;
  bad.eval_positions = {6};  // the last position has no target
  EXPECT_THROW(Packer(4).add(bad), Error);
  EXPECT_THROW(Packer(0), Error);
  // check_batch names what is wrong.
  Batch broken = b2;
  broken.targets = Tensor::from_vector<int64_t>({5}, {10, 11, 300, 2, kIgnoreIndex});
  EXPECT_NE(testing::error_of([&] { check_batch(broken, 50); }).find("targets[2] = 300"),
            std::string::npos);
  broken = b2;
  broken.cu_seqlens = Tensor::from_vector<int64_t>({3}, {0, 3, 4});
  EXPECT_NE(testing::error_of([&] { check_batch(broken, 50); }).find("cu_seqlens"),
            std::string::npos);
}

// ---- MQAR --------------------------------------------------------------------------------------

MqarConfig small_mqar(uint64_t seed) {
  MqarConfig c;
  c.vocab_size = 96;
  c.num_keys = 64;  // values [64, 96): 32 of them
  c.min_pairs = 1;
  c.max_pairs = 12;
  c.query_fraction = 0.5;
  c.tokens_per_step = 512;
  c.eval_batches = 3;
  c.seed = seed;
  return c;
}

TEST(Mqar, DeterministicForSeedAndStep) {
  const uint64_t seed = testing::test_seed();
  MqarTask a(small_mqar(seed)), b(small_mqar(seed)), c(small_mqar(seed + 1));
  EXPECT_TRUE(batches_equal(a.batch(7), b.batch(7)));
  EXPECT_TRUE(batches_equal(a.batch(7), a.batch(7)));
  EXPECT_TRUE(batches_equal(a.eval_batch(2), b.eval_batch(2)));
  EXPECT_FALSE(testing::bit_equal(a.batch(7).tokens, a.batch(8).tokens));
  EXPECT_FALSE(testing::bit_equal(a.batch(7).tokens, c.batch(7).tokens));
  EXPECT_FALSE(testing::bit_equal(a.batch(0).tokens, a.eval_batch(0).tokens));
  EXPECT_FALSE(testing::bit_equal(a.eval_batch(0).tokens, a.eval_batch(1).tokens));
  EXPECT_THROW(a.eval_batch(3), Error);
  EXPECT_THROW(a.batch(-1), Error);
}

TEST(Mqar, FormatInvariants) {
  const MqarConfig cfg = small_mqar(testing::test_seed());
  MqarTask task(cfg);
  std::set<int64_t> lengths;
  int64_t complete_docs = 0;
  for (int64_t step = 0; step < 6; ++step) {
    const Batch b = step < 5 ? task.batch(step) : task.eval_batch(0);
    check_batch(b, cfg.vocab_size);
    ASSERT_EQ(b.num_tokens(), cfg.tokens_per_step);  // the budget, exactly
    const auto tok = ints(b.tokens), tgt = ints(b.targets), cu = ints(b.cu_seqlens),
               ev = ints(b.eval_positions);
    EXPECT_GT(b.num_sequences(), 10);
    std::set<int64_t> evset(ev.begin(), ev.end());
    // Answers only: the loss is exactly on the eval positions.
    for (int64_t t = 0; t < b.num_tokens(); ++t)
      EXPECT_EQ(tgt[size_t(t)] != kIgnoreIndex, evset.count(t) == 1) << t;
    for (int64_t n = 0; n < b.num_sequences(); ++n) {
      const int64_t s = cu[size_t(n)], e = cu[size_t(n + 1)], L = e - s;
      const bool last = n + 1 == b.num_sequences();
      // The first eval position of the sequence starts the query section at offset 2P.
      auto it = evset.lower_bound(s);
      if (it == evset.end() || *it >= e) {
        EXPECT_TRUE(last) << "only a cut last document may lack queries";
        continue;
      }
      const int64_t P = (*it - s) / 2;
      EXPECT_EQ((*it - s) % 2, 0);
      EXPECT_GE(P, cfg.min_pairs);
      EXPECT_LE(P, cfg.max_pairs);
      std::map<int64_t, int64_t> pairs;
      for (int64_t i = 0; i < P; ++i) {
        const int64_t k = tok[size_t(s + 2 * i)], v = tok[size_t(s + 2 * i + 1)];
        EXPECT_TRUE(k >= 0 && k < cfg.num_keys) << "key " << k;
        EXPECT_TRUE(v >= cfg.num_keys && v < cfg.vocab_size) << "value " << v;
        EXPECT_TRUE(pairs.emplace(k, v).second) << "keys of a document are distinct";
      }
      // Query section: q a q a ..., q a key of this document, its target (and the next token) its
      // value; queries distinct.
      std::set<int64_t> asked;
      int64_t queries = 0;
      for (int64_t p = s + 2 * P; p < e; p += 2) {
        EXPECT_EQ(evset.count(p), 1u) << p;
        const int64_t q = tok[size_t(p)];
        ASSERT_TRUE(pairs.count(q)) << "query " << q << " is not a key of its document";
        EXPECT_EQ(tgt[size_t(p)], pairs[q]);
        if (p + 1 < e) EXPECT_EQ(tok[size_t(p + 1)], pairs[q]);
        EXPECT_TRUE(asked.insert(q).second);
        ++queries;
      }
      if (!last) {  // a complete document: L = 2P + 2Q
        const int64_t Q = (L - 2 * P) / 2;
        EXPECT_EQ(L % 2, 0);
        EXPECT_EQ(Q, std::clamp<int64_t>(std::llround(0.5 * double(P)), 1, P));
        EXPECT_EQ(queries, Q);
        lengths.insert(L);
        ++complete_docs;
      }
    }
  }
  EXPECT_GT(complete_docs, 60);
  EXPECT_GE(lengths.size(), 8u);  // random lengths: packing and restarts are exercised
}

TEST(Mqar, LossOnAllTokensKeepsTheDocuments) {
  MqarConfig cfg = small_mqar(testing::test_seed());
  MqarTask answers(cfg);
  cfg.loss_on_all_tokens = true;
  MqarTask all(cfg);
  const Batch a = answers.batch(3), b = all.batch(3);
  check_batch(b, cfg.vocab_size);
  EXPECT_TRUE(testing::bit_equal(a.tokens, b.tokens));
  EXPECT_TRUE(testing::bit_equal(a.cu_seqlens, b.cu_seqlens));
  EXPECT_TRUE(testing::bit_equal(a.eval_positions, b.eval_positions));
  const auto tok = ints(b.tokens), tgt = ints(b.targets), cu = ints(b.cu_seqlens);
  for (int64_t n = 0; n < b.num_sequences(); ++n) {
    const int64_t s = cu[size_t(n)], e = cu[size_t(n + 1)];
    for (int64_t t = s; t + 1 < e; ++t) EXPECT_EQ(tgt[size_t(t)], tok[size_t(t + 1)]);
    if (n + 1 < b.num_sequences()) EXPECT_EQ(tgt[size_t(e - 1)], kIgnoreIndex) << "document end";
  }
  EXPECT_GT(b.num_loss_tokens(), 3 * a.num_loss_tokens());
}

TEST(Mqar, AccuracyPerfectAndChance) {
  MqarConfig cfg = small_mqar(testing::test_seed());
  cfg.eval_batches = 40;
  MqarTask task(cfg);
  EXPECT_DOUBLE_EQ(task.chance_accuracy(), 1.0 / 32);
  Accuracy perfect_logits, perfect_ids, random_ids, random_q;
  Rng rng(testing::test_seed() + 1);
  for (int64_t i = 0; i < task.num_eval_batches(); ++i) {
    const Batch b = task.eval_batch(i);
    const int64_t T = b.num_tokens(), V = cfg.vocab_size;
    const auto tgt = ints(b.targets);
    // Logits: noise in [-1, 1) everywhere, +5 at the target.
    Tensor logits = rand_uniform({T, V}, DType::f32, rng, -1, 1);
    float* l = logits.data<float>();
    for (int64_t t = 0; t < T; ++t)
      if (tgt[size_t(t)] >= 0) l[t * V + tgt[size_t(t)]] += 5;
    perfect_logits += accuracy_from_logits(b, logits);
    perfect_ids += accuracy_from_ids(b, b.targets);
    // A random predictor among the values: chance level.
    std::vector<int64_t> pred(static_cast<size_t>(T)), predq;
    for (auto& p : pred) p = cfg.num_keys + int64_t(rng.below(uint64_t(task.num_values())));
    random_ids += accuracy_from_ids(b, Tensor::from_vector<int64_t>({T}, pred));
    for (int64_t p : ints(b.eval_positions)) predq.push_back(pred[size_t(p)]);
    random_q += accuracy_from_ids(b, Tensor::from_vector<int64_t>({int64_t(predq.size())}, predq));
  }
  EXPECT_GT(perfect_logits.total, 2500);
  EXPECT_EQ(perfect_logits.correct, perfect_logits.total);
  EXPECT_EQ(perfect_logits.value(), 1.0);
  EXPECT_EQ(perfect_ids.value(), 1.0);
  // Binomial(n, 1/32): 5 standard deviations.
  const double n = double(random_ids.total), p = task.chance_accuracy();
  EXPECT_NEAR(random_ids.value(), p, 5 * std::sqrt(p * (1 - p) / n));
  EXPECT_GT(random_ids.correct, 0);
  EXPECT_EQ(random_q.correct, random_ids.correct);  // [Q] form gives the same answer
  // Ties go to the lowest id, a NaN row is wrong.
  Batch b;
  b.tokens = Tensor::from_vector<int64_t>({2}, {0, 1});
  b.targets = Tensor::from_vector<int64_t>({2}, {2, 1});
  b.eval_positions = Tensor::from_vector<int64_t>({2}, {0, 1});
  Tensor lg = Tensor::from_values({2, 3}, {0, 1, 1, 0, 1, NAN}, DType::f32);
  const Accuracy tie = accuracy_from_logits(b, lg);
  EXPECT_EQ(tie.total, 2);
  EXPECT_EQ(tie.correct, 0);
  lg = Tensor::from_values({2, 3}, {0, 1, 2, 0, 1, 1}, DType::f64);
  EXPECT_EQ(accuracy_from_logits(b, lg).correct, 2);
  EXPECT_THROW(accuracy_from_logits(b, Tensor::zeros({3, 3}, DType::f32)), Error);
  EXPECT_THROW(accuracy_from_ids(b, Tensor::zeros({5}, DType::i64)), Error);
}

TEST(Mqar, RejectsBadConfig) {
  auto bad = [](auto edit, const char* msg) {
    MqarConfig c;
    edit(c);
    EXPECT_NE(testing::error_of([&] { MqarTask t(c); }).find(msg), std::string::npos) << msg;
  };
  bad([](MqarConfig& c) { c.num_keys = 256; }, "vocab_size");
  bad([](MqarConfig& c) { c.min_pairs = 0; }, "min_pairs");
  bad([](MqarConfig& c) { c.max_pairs = 200; }, "max_pairs");
  bad([](MqarConfig& c) { c.query_fraction = 0; }, "query_fraction");
  bad([](MqarConfig& c) { c.tokens_per_step = 63; }, "tokens_per_step");
  MqarTask ok(MqarConfig{});
  EXPECT_NE(ok.describe().find("chance accuracy"), std::string::npos);
}

// ---- token streams -----------------------------------------------------------------------------

TEST(DataText, ByteLevelWindowsWithBos) {
  const std::string path = ::testing::TempDir() + "/train_data_text.txt";
  std::string text;
  for (int i = 0; i < 30; ++i)
    text += "line " + std::to_string(i) + ": gr\xc3\xbc\xc3\x9f \xe2\x82\xac\n";
  write_bytes(path, std::vector<uint8_t>(text.begin(), text.end()));
  TokenStreamConfig cfg;
  cfg.tokens_per_step = 64;
  cfg.seq_len = 16;
  cfg.seed = 5;
  auto src = open_data_file(path, 0, cfg);
  EXPECT_EQ(src->vocab_size(), kByteVocab);
  const int64_t N = int64_t(text.size()), W = N / 16;
  ASSERT_EQ(W % 4, 0);  // whole epochs of 4 windows per step below
  EXPECT_EQ(src->num_windows(), W);
  EXPECT_EQ(src->num_tokens(), N);
  std::vector<int> seen(size_t(W), 0);
  const int64_t steps = 3 * W / 4;  // three epochs of windows (4 per step)
  for (int64_t step = 0; step < steps; ++step) {
    const Batch b = src->batch(step);
    check_batch(b, kByteVocab);
    ASSERT_EQ(b.num_tokens(), 64);
    EXPECT_EQ(ints(b.cu_seqlens), (std::vector<int64_t>{0, 16, 32, 48, 64}));
    EXPECT_EQ(b.eval_positions.numel(), 0);
    const auto tok = ints(b.tokens), tgt = ints(b.targets);
    for (int64_t j = 0; j < 4; ++j) {
      const int64_t w = src->window_of_draw(step * 4 + j);
      ++seen[size_t(w)];
      EXPECT_EQ(tok[size_t(16 * j)], kByteBos);
      for (int64_t i = 0; i < 16; ++i) {
        if (i > 0) EXPECT_EQ(tok[size_t(16 * j + i)], uint8_t(text[size_t(16 * w + i - 1)]));
        EXPECT_EQ(tgt[size_t(16 * j + i)], uint8_t(text[size_t(16 * w + i)]));
      }
    }
  }
  // Each epoch is a permutation of the windows: every window drawn exactly three times.
  for (int64_t w = 0; w < W; ++w) EXPECT_EQ(seen[size_t(w)], 3) << w;
  // Shuffled (not in file order), and the order differs between epochs.
  std::vector<int64_t> e0, e1;
  for (int64_t k = 0; k < W; ++k) e0.push_back(src->window_of_draw(k));
  for (int64_t k = W; k < 2 * W; ++k) e1.push_back(src->window_of_draw(k));
  EXPECT_NE(e0, e1);
  // The position is just the step: a fresh source gives the same batch.
  auto again = open_data_file(path, 258, cfg);
  EXPECT_TRUE(batches_equal(src->batch(steps - 1), again->batch(steps - 1)));
  EXPECT_TRUE(batches_equal(src->batch(2), again->batch(2)));
  // In order when not shuffled.
  cfg.shuffle = false;
  auto ordered = open_text_file(path, cfg);
  for (int64_t k = 0; k < 2 * W; ++k) EXPECT_EQ(ordered->window_of_draw(k), k % W);
  EXPECT_NE(testing::error_of([&] { open_data_file(path, 100, cfg); }).find("at least 258"),
            std::string::npos);
}

TEST(DataText, InvalidUtf8AndShortFiles) {
  const std::string path = ::testing::TempDir() + "/train_data_bad.txt";
  write_bytes(path, {'a', 'b', 'c', 0xc3, 0x28, 'd'});
  TokenStreamConfig cfg;
  cfg.tokens_per_step = 2;
  EXPECT_NE(
      testing::error_of([&] { open_text_file(path, cfg); }).find("invalid UTF-8 at byte offset 3"),
      std::string::npos);
  write_bytes(path, {'a', 0xe0, 0x80, 0x80});  // overlong
  EXPECT_NE(testing::error_of([&] { open_text_file(path, cfg); }).find("offset 1"),
            std::string::npos);
  write_bytes(path, {'a'});
  EXPECT_NE(testing::error_of([&] { open_text_file(path, cfg); }).find("fewer than one window"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] { open_text_file(path + ".missing", cfg); }).find("cannot open"),
            std::string::npos);
}

TEST(DataBin, ReadsLittleEndianIdsAndChecksTheVocab) {
  const std::string path = ::testing::TempDir() + "/train_data_ids.bin";
  std::vector<uint32_t> ids;
  // Ids above 2^24 so that all four bytes matter.
  for (uint32_t i = 0; i < 101; ++i)
    ids.push_back(uint32_t((uint64_t(i) * 2654435761u) % 40000000u));
  write_u32(path, ids);
  TokenStreamConfig cfg;
  cfg.tokens_per_step = 20;
  cfg.seq_len = 10;
  cfg.shuffle = false;
  auto src = open_data_file(path, 40000000, cfg);
  EXPECT_EQ(src->num_windows(), 10);  // (101 - 1) / 10
  const Batch b = src->batch(1);      // windows 2 and 3
  check_batch(b, 40000000);
  const auto tok = ints(b.tokens), tgt = ints(b.targets);
  for (int64_t i = 0; i < 20; ++i) {
    EXPECT_EQ(tok[size_t(i)], int64_t(ids[size_t(20 + i)]));
    EXPECT_EQ(tgt[size_t(i)], int64_t(ids[size_t(21 + i)]));  // the last target crosses the window
  }
  EXPECT_TRUE(batches_equal(src->batch(5), src->batch(0)));  // epoch 2 (in order) repeats
  // Out of vocabulary: the error names the id, its position and byte offset.
  EXPECT_GT(*std::max_element(ids.begin(), ids.end()), 1u << 24);
  ids[37] = 40000000;
  write_u32(path, ids);
  const std::string oov = testing::error_of([&] { open_bin_file(path, 40000000, cfg); });
  EXPECT_NE(
      oov.find("token id 40000000 at position 37 (byte offset 148) is >= vocab_size 40000000"),
      std::string::npos)
      << oov;
  write_bytes(path, {1, 0, 0, 0, 2, 0});
  EXPECT_NE(testing::error_of([&] { open_bin_file(path, 10, cfg); }).find("not a multiple of 4"),
            std::string::npos);
  EXPECT_THROW(open_bin_file(path, 0, cfg), Error);
  cfg.seq_len = 7;  // does not divide 20
  write_u32(path, {1, 2, 3});
  EXPECT_NE(testing::error_of([&] { open_bin_file(path, 10, cfg); }).find("divide"),
            std::string::npos);
}

TEST(DataBin, EosSeparatesDocuments) {
  // ids: documents separated by EOS = 9.
  std::vector<uint32_t> ids = {1, 2, 9, 3, 4, 5, 9, 6, 9, 7, 8, 1, 2};
  TokenStreamConfig cfg;
  cfg.tokens_per_step = 12;
  cfg.shuffle = false;
  cfg.eos_id = 9;
  TokenStream src(ids, 10, cfg, "ids");
  const Batch b = src.batch(0);
  check_batch(b, 10);
  EXPECT_EQ(ints(b.tokens), (std::vector<int64_t>{1, 2, 9, 3, 4, 5, 9, 6, 9, 7, 8, 1}));
  EXPECT_EQ(ints(b.cu_seqlens), (std::vector<int64_t>{0, 3, 7, 9, 12}));
  EXPECT_EQ(ints(b.targets), (std::vector<int64_t>{2, 9, kIgnoreIndex, 4, 5, 9, kIgnoreIndex, 9,
                                                   kIgnoreIndex, 8, 1, 2}));
  cfg.eos_id = -1;
  EXPECT_NE(
      testing::error_of([&] { TokenStream(ids, 9, cfg, "ids"); }).find("token id 9 at position 2"),
      std::string::npos);
}

}  // namespace
}  // namespace hlm::train
