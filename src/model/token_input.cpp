#include "model/token_input.h"

#include <algorithm>
#include <set>

#include "core/error.h"
#include "core/seq_layout.h"

namespace hlm {

namespace {

bool integer_dtype(DType dt) {
  return dt == DType::i64 || dt == DType::i32 || dt == DType::u8;
}

}  // namespace

TokenBatch read_token_batch(const safetensors::Contents& in, int64_t vocab_size,
                            const std::string& what) {
  for (const auto& [name, t] : in.tensors)
    HLM_CHECK(name == "input_ids" || name == "cu_seqlens",
              "{}: unexpected tensor '{}' (a token file holds input_ids and, for [T] ids, "
              "cu_seqlens)",
              what, name);
  auto it = in.tensors.find("input_ids");
  HLM_CHECK(it != in.tensors.end(), "{}: no tensor input_ids", what);
  const Tensor& ids = it->second;
  HLM_CHECK(integer_dtype(ids.dtype()),
            "{}: input_ids must be an integer tensor (I64, I32 or U8), got {}", what,
            dtype_name(ids.dtype()));
  HLM_CHECK(ids.dim() == 1 || ids.dim() == 2, "{}: input_ids must be [B, T] or [T], got {}", what,
            ids.describe());
  HLM_CHECK(ids.numel() >= 1, "{}: input_ids {} holds no tokens", what, ids.describe());
  TokenBatch b;
  b.tokens = ids.contiguous().view({ids.numel()}).to(DType::i64);
  const int64_t* p = b.tokens.data<int64_t>();
  for (int64_t i = 0; i < b.tokens.numel(); ++i)
    HLM_CHECK(p[i] >= 0 && p[i] < vocab_size,
              "{}: input_ids holds {} at flat index {}, outside the vocabulary [0, {})", what, p[i],
              i, vocab_size);
  auto cu = in.tensors.find("cu_seqlens");
  if (ids.dim() == 2) {
    HLM_CHECK(cu == in.tensors.end(),
              "{}: cu_seqlens is given with [B, T] input_ids, whose rows are the sequences "
              "already; give [T] ids with cu_seqlens, or [B, T] ids alone",
              what);
    b.rows = true;
    b.batch = ids.size(0);
    b.length = ids.size(1);
    b.cu_seqlens =
        SeqLayout::from_lengths(std::vector<int64_t>(size_t(b.batch), b.length)).cu_seqlens();
    b.sequences = b.batch;
    b.max_seq_len = b.length;
    return b;
  }
  b.length = ids.size(0);
  if (cu == in.tensors.end()) {
    b.cu_seqlens = SeqLayout::single(b.length).cu_seqlens();
  } else {
    const std::string w = what + ": cu_seqlens";
    HLM_CHECK(cu->second.dtype() == DType::i64 || cu->second.dtype() == DType::i32,
              "{} must be I64 or I32, got {}", w, dtype_name(cu->second.dtype()));
    b.cu_seqlens = SeqLayout::from_tensor(cu->second, b.length, w.c_str()).cu_seqlens();
  }
  const auto v = b.cu_seqlens.to_f64_vector();
  b.sequences = int64_t(v.size()) - 1;
  for (size_t n = 0; n + 1 < v.size(); ++n)
    b.max_seq_len = std::max(b.max_seq_len, int64_t(v[n + 1] - v[n]));
  return b;
}

std::vector<Tensor> read_dsa_indices(const safetensors::Contents& in, const ModelConfig& cfg,
                                     const TokenBatch& batch, const std::string& what) {
  std::vector<Tensor> out;
  std::set<std::string> used;
  const int64_t B = batch.batch, T = batch.length;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    if (cfg.layer_kind(l) != LayerKind::dsa) continue;
    const std::string name = "layers." + std::to_string(l);
    auto f = in.tensors.find(name);
    if (f == in.tensors.end()) {
      out.emplace_back();
      continue;
    }
    used.insert(name);
    const Tensor& src = f->second;
    const std::string w = what + ": " + name;
    HLM_CHECK(src.dtype() == DType::i64 || src.dtype() == DType::i32,
              "{} must be I64 or I32, got {}", w, dtype_name(src.dtype()));
    Tensor t = src.to(DType::i64).contiguous();
    int64_t* p = t.data<int64_t>();
    if (batch.rows) {
      HLM_CHECK(t.dim() == 3 && t.size(0) == B && t.size(1) == T && t.size(2) >= 1,
                "{} must be [{}, {}, W] (positions local to the row), got {}", w, B, T,
                t.describe());
      const int64_t W = t.size(2);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < T * W; ++i) {
          int64_t& x = p[b * T * W + i];
          HLM_CHECK(x == -1 || (x >= 0 && x < T),
                    "{}[{}, {}, {}] = {}: expected -1 (padding) or a position in [0, {})", w, b,
                    i / W, i % W, x, T);
          if (x >= 0) x += b * T;  // local position -> global id
        }
      t = t.view({B * T, W});
    } else {
      HLM_CHECK(t.dim() == 2 && t.size(0) == T && t.size(1) >= 1,
                "{} must be [{}, W] (global token ids for [T] input_ids), got {}", w, T,
                t.describe());
      for (int64_t i = 0; i < t.numel(); ++i)
        HLM_CHECK(p[i] == -1 || (p[i] >= 0 && p[i] < T),
                  "{}[{}, {}] = {}: expected -1 (padding) or a token id in [0, {})", w,
                  i / t.size(1), i % t.size(1), p[i], T);
    }
    out.push_back(t);
  }
  for (const auto& [name, t] : in.tensors)
    HLM_CHECK(used.count(name),
              "{}: tensor '{}' is not the selection of a DSA layer (expected layers.<i> for the "
              "DSA layers of the main stack)",
              what, name);
  return out;
}

}  // namespace hlm
