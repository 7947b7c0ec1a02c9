// Generator (infer/generator.h): admission, the packed step, sampling.
#include "infer/generator.h"

#include <algorithm>

#include "core/error.h"
#include "ops/tensor_ops.h"
#include "ops/token_pick.h"

namespace hlm::infer {

namespace {

// The cache options with the model's device.
CacheOptions on_model(const HybridModel& model, CacheOptions o) {
  o.device = model.device();
  return o;
}

}  // namespace

Generator::Generator(const HybridModel& model, const CacheOptions& cache)
    : model_(model), cache_(model.config(), model.compute_dtype(), on_model(model, cache)) {
  HLM_CHECK(!cache.speculative || model.has_mtp(),
            "generate: speculative decoding drafts with the MTP block; the model was built "
            "without one");
}

int64_t Generator::pages_for(int64_t tokens) const {
  return (tokens + cache_.page_tokens() - 1) / cache_.page_tokens();
}

int64_t Generator::most_tokens(const Request& r) const {
  // The last token generated is never fed; a speculative step also writes a draft's rows.
  return int64_t(r.prompt.size()) + std::max<int64_t>(0, r.max_new - 1) +
         (cache_.speculative() ? 1 : 0);
}

int64_t Generator::reserved_pages() const {
  int64_t r = 0;
  for (const auto& s : running_)
    r += std::max<int64_t>(0, pages_for(most_tokens(s->req)) - cache_.pages_held(s->slot));
  return r;
}

void Generator::check(const Request& r) const {
  const int64_t V = model_.config().vocab_size, P = int64_t(r.prompt.size());
  HLM_CHECK(P >= 1, "generate: the prompt is empty");
  for (size_t i = 0; i < r.prompt.size(); ++i)
    HLM_CHECK(r.prompt[i] >= 0 && r.prompt[i] < V,
              "generate: prompt token {} is {}, outside the vocabulary [0, {})", i, r.prompt[i], V);
  for (int64_t s : r.stop)
    HLM_CHECK(s >= 0 && s < V, "generate: stop token {} is outside the vocabulary [0, {})", s, V);
  HLM_CHECK(r.max_new >= 0 && r.max_new <= (int64_t(1) << 30),
            "generate: max_new must be in [0, 2^30], got {}", r.max_new);
  r.sampling.validate();
  HLM_CHECK(!cache_.speculative() || r.sampling.greedy(),
            "speculative decoding is greedy only (temperature 0)");
  const int64_t most = most_tokens(r);
  const int64_t room = cache_.bytes().num_pages * cache_.page_tokens();
  HLM_CHECK(pages_for(most) <= cache_.bytes().num_pages,
            "generate: the prompt ({} tokens) and max_new ({}) need {} tokens of cache, the cache "
            "holds {}",
            P, r.max_new, most, room);
}

int64_t Generator::submit(Request r) {
  check(r);
  auto s = std::make_unique<Seq>();
  s->id = next_id_++;
  s->req = std::move(r);
  waiting_.push_back(std::move(s));
  return waiting_.back()->id;
}

void Generator::admit() {
  // Admit waiting requests in order while a slot and their whole budget are free.
  int64_t budget = cache_.free_pages() - reserved_pages();
  while (!waiting_.empty() && cache_.free_slots() > 0) {
    Seq& s = *waiting_.front();
    const int64_t need = pages_for(most_tokens(s.req));
    if (need > budget) break;
    budget -= need;
    s.slot = cache_.open();
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
}

ops::SampleRow Generator::pick_for(const Seq& s) {
  const SamplingParams& p = s.req.sampling;
  ops::SampleRow r{p.temperature, p.top_k, p.top_p, 0.0};
  if (!p.greedy()) r.u = draw(p.seed, s.req.stream, uint64_t(s.res.tokens.size()));
  return r;
}

bool Generator::emit(Seq& s, const Rows& rows, int64_t row, std::vector<TokenEvent>& events) {
  const int64_t bad = rows.pick[size_t(row)].bad;
  HLM_CHECK(bad < 0, "sampling: the logit of token {} is not finite", bad);
  const Sampled t{rows.pick[size_t(row)].token, rows.pick[size_t(row)].logprob};
  s.res.tokens.push_back(t.token);
  s.res.logprobs.push_back(t.logprob);
  const bool stop = std::find(s.req.stop.begin(), s.req.stop.end(), t.token) != s.req.stop.end();
  const bool finished = stop || int64_t(s.res.tokens.size()) >= s.req.max_new;
  if (finished) s.res.finish = stop ? "stop" : "length";
  s.next = t.token;
  events.push_back({s.id, t.token, t.logprob, finished});
  return finished;
}

void Generator::retire(const std::vector<bool>& finished) {
  std::vector<std::unique_ptr<Seq>> still;
  for (size_t i = 0; i < running_.size(); ++i) {
    if (finished[i]) {
      cache_.close(running_[i]->slot);
      done_.emplace_back(running_[i]->id, std::move(running_[i]->res));
    } else {
      still.push_back(std::move(running_[i]));
    }
  }
  running_ = std::move(still);
}

// A packed forward's inputs, sequence by sequence, and where each sequence's logits rows start.
struct Generator::Batch {
  std::vector<int64_t> tokens, cu = {0}, slots, rows, first_row;
  std::vector<int64_t> scored;  // per logits row: the prompt token it scores, or -1
  // Seq s's prompt: logits for every prompt row when it scores its prompt, else for its last.
  void add_prompt(const Seq& s) {
    first_row.push_back(int64_t(rows.size()));
    const int64_t t0 = int64_t(tokens.size());
    tokens.insert(tokens.end(), s.req.prompt.begin(), s.req.prompt.end());
    if (s.req.prompt_logprobs)
      for (int64_t r = t0; r + 1 < int64_t(tokens.size()); ++r) {
        rows.push_back(r);
        scored.push_back(tokens[size_t(r + 1)]);
      }
    rows.push_back(int64_t(tokens.size()) - 1);
    scored.push_back(-1);
    end(s);
  }
  // Tokens of s, with logits for each.
  void add_tokens(const Seq& s, std::initializer_list<int64_t> t) {
    first_row.push_back(int64_t(rows.size()));
    for (int64_t v : t) {
      rows.push_back(int64_t(tokens.size()));
      scored.push_back(-1);
      tokens.push_back(v);
    }
    end(s);
  }
  void end(const Seq& s) {
    cu.push_back(int64_t(tokens.size()));
    slots.push_back(s.slot);
  }
};

ModelOutput Generator::forward(const Batch& b, bool draft_last,
                               const std::vector<ops::SampleRow>& picks, Rows* rows) {
  ModelInputs in;
  in.tokens = Tensor::from_vector({int64_t(b.tokens.size())}, b.tokens);
  in.cu_seqlens = Tensor::from_vector({int64_t(b.cu.size())}, b.cu);
  in.cache = &cache_;
  in.cache_slots = b.slots;
  in.logit_rows = b.rows;
  in.draft_last = draft_last;
  in.aux_losses = false;
  Context ctx;
  ctx.training = false;
  ModelOutput out = model_.forward(ctx, in);
  ++forwards_;
  if (std::any_of(b.scored.begin(), b.scored.end(), [](int64_t t) { return t >= 0; })) {
    std::vector<int64_t> given(b.scored.size());
    for (size_t r = 0; r < given.size(); ++r) given[r] = std::max<int64_t>(0, b.scored[r]);
    rows->score = ops::score_tokens(out.logits, given).to_host();
  }
  const bool greedy = std::all_of(picks.begin(), picks.end(),
                                  [](const ops::SampleRow& p) { return p.temperature == 0; });
  const ops::TokenPick p =
      greedy ? ops::greedy_pick(out.logits) : ops::sample_pick(out.logits, picks);
  rows->pick = p.to_host();
  return out;
}

bool Generator::finish_prefill(Seq& s, const Rows& rows, int64_t row,
                               std::vector<TokenEvent>& events) {
  if (s.req.prompt_logprobs)
    for (size_t j = 0; j + 1 < s.req.prompt.size(); ++j, ++row) {
      const int64_t bad = rows.score[size_t(row)].bad;
      HLM_CHECK(bad < 0, "sampling: the logit of token {} is not finite", bad);
      s.res.prompt_logprobs.push_back(rows.score[size_t(row)].logprob);
    }
  s.prefilled = true;
  if (s.req.max_new > 0) return emit(s, rows, row, events);
  s.res.finish = "length";
  events.push_back({s.id, -1, 0.0, true});
  return true;
}

std::vector<TokenEvent> Generator::step() {
  if (cache_.speculative()) return step_speculative();
  admit();
  std::vector<TokenEvent> events;
  if (running_.empty()) return events;
  // The packed batch: each new sequence's prompt, one token of each running one.
  Batch b;
  for (const auto& s : running_) s->prefilled ? b.add_tokens(*s, {s->next}) : b.add_prompt(*s);
  // Each sequence's sampled row: its last (after its prompt's rows when it scores its prompt).
  std::vector<ops::SampleRow> picks(b.rows.size());
  for (size_t i = 0; i < running_.size(); ++i) {
    const Seq& s = *running_[i];
    if (!s.prefilled && s.req.max_new <= 0) continue;
    const int64_t skip =
        !s.prefilled && s.req.prompt_logprobs ? int64_t(s.req.prompt.size()) - 1 : 0;
    picks[size_t(b.first_row[i] + skip)] = pick_for(s);
  }
  Rows rows;
  forward(b, false, picks, &rows);
  std::vector<bool> finished(running_.size(), false);
  for (size_t i = 0; i < running_.size(); ++i) {
    Seq& s = *running_[i];
    finished[i] = s.prefilled ? emit(s, rows, b.first_row[i], events)
                              : finish_prefill(s, rows, b.first_row[i], events);
  }
  retire(finished);
  return events;
}

void Generator::draft(const std::vector<Seq*>& seqs, const std::vector<std::vector<int64_t>>& next,
                      const std::vector<std::vector<int64_t>>& rows, const Tensor& pre_norm) {
  if (seqs.empty()) return;
  std::vector<int64_t> tok, all_rows, lengths, slots;
  for (size_t i = 0; i < seqs.size(); ++i) {
    tok.insert(tok.end(), next[i].begin(), next[i].end());
    all_rows.insert(all_rows.end(), rows[i].begin(), rows[i].end());
    lengths.push_back(int64_t(next[i].size()));
    slots.push_back(seqs[i]->slot);
  }
  const Tensor logits = model_.mtp_forward_cached(Tensor::from_vector({int64_t(tok.size())}, tok),
                                                  ops::gather_rows(pre_norm, all_rows),
                                                  SeqLayout::from_lengths(lengths), cache_, slots);
  // A draft is the arg max of its sequence's last row (ties to the lower id).
  const std::vector<int64_t> best = ops::greedy_pick(logits).token.to_i64_vector();
  int64_t end = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    end += lengths[i];
    seqs[i]->draft = best[size_t(end - 1)];
  }
}

std::vector<TokenEvent> Generator::step_speculative() {
  admit();
  std::vector<TokenEvent> events;
  if (running_.empty()) return events;
  std::vector<bool> finished(running_.size(), false);
  std::vector<Seq*> drafting;
  std::vector<std::vector<int64_t>> next, hrows;
  const bool prefill =
      std::any_of(running_.begin(), running_.end(), [](const auto& s) { return !s->prefilled; });
  if (prefill) {
    // The new prompts alone; then their MTP rows (each reading the token after its position:
    // the prompt's next token, and for the last one the token just generated) and first drafts.
    Batch b;
    std::vector<size_t> idx;
    for (size_t i = 0; i < running_.size(); ++i)
      if (!running_[i]->prefilled) {
        idx.push_back(i);
        b.add_prompt(*running_[i]);
      }
    Rows rows;
    const ModelOutput out = forward(b, false, std::vector<ops::SampleRow>(b.rows.size()), &rows);
    for (size_t k = 0; k < idx.size(); ++k) {
      Seq& s = *running_[idx[k]];
      finished[idx[k]] = finish_prefill(s, rows, b.first_row[k], events);
      if (finished[idx[k]]) continue;
      drafting.push_back(&s);
      next.emplace_back(s.req.prompt.begin() + 1, s.req.prompt.end());
      next.back().push_back(s.next);
      hrows.emplace_back();
      for (int64_t r = b.cu[k]; r < b.cu[k + 1]; ++r) hrows.back().push_back(r);
    }
    draft(drafting, next, hrows, out.pre_norm);
    retire(finished);
    return events;
  }

  // Every sequence: [next, draft].
  Batch b;
  for (const auto& s : running_) b.add_tokens(*s, {s->next, s->draft});
  Rows rows;
  const ModelOutput out = forward(b, true, std::vector<ops::SampleRow>(b.rows.size()), &rows);
  std::vector<bool> accepted(running_.size(), false);
  for (size_t i = 0; i < running_.size(); ++i) {
    Seq& s = *running_[i];
    const int64_t r0 = 2 * int64_t(i), r1 = r0 + 1;
    finished[i] = emit(s, rows, r0, events);
    ++drafts_;
    accepted[i] = s.next == s.draft;
    accepted_ += accepted[i];
    if (finished[i]) continue;
    if (!accepted[i]) {
      drafting.push_back(&s);
      next.push_back({s.next});
      hrows.push_back({r0});
      continue;
    }
    const int64_t y1 = s.next;
    finished[i] = emit(s, rows, r1, events);
    if (finished[i]) continue;
    drafting.push_back(&s);
    next.push_back({y1, s.next});
    hrows.push_back({r0, r1});
  }
  cache_.accept_drafts(b.slots, accepted);
  draft(drafting, next, hrows, out.pre_norm);
  retire(finished);
  return events;
}

bool Generator::cancel(int64_t id) {
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it)
    if ((*it)->id == id) {
      waiting_.erase(it);
      return true;
    }
  for (auto it = running_.begin(); it != running_.end(); ++it)
    if ((*it)->id == id) {
      cache_.close((*it)->slot);
      running_.erase(it);
      return true;
    }
  return false;
}

void Generator::cancel_all() {
  for (const auto& s : running_) cache_.close(s->slot);
  running_.clear();
  waiting_.clear();
}

Result Generator::take(int64_t id) {
  for (auto it = done_.begin(); it != done_.end(); ++it)
    if (it->first == id) {
      Result r = std::move(it->second);
      done_.erase(it);
      return r;
    }
  throw Error(fmt::format("Generator::take: request {} is unknown or not finished", id));
}

std::vector<Result> Generator::run(const std::vector<Request>& reqs,
                                   const std::function<void(const TokenEvent&)>& on_token) {
  for (const Request& r : reqs) check(r);
  std::vector<int64_t> ids;
  for (const Request& r : reqs) ids.push_back(submit(r));
  while (busy()) {
    const std::vector<TokenEvent> ev = step();
    if (on_token)
      for (const TokenEvent& e : ev) on_token(e);
  }
  std::vector<Result> out;
  for (int64_t id : ids) out.push_back(take(id));
  return out;
}

}  // namespace hlm::infer
