// Generator: text generation over a ModelCache with continuous batching (docs/inference.md,
// "Generation").
//
// Requests are submitted at any time. Each step() is one forward of the model over a packed
// batch: the prompts of the requests admitted this step (prefill through the chunked paths) and
// one token of every running request (decode), each sequence continuing its cache slot. The
// next token of each sequence is sampled from its last row's logits (infer/sampling.h; the draw
// is Philox at (sampling.seed, Request::stream, the number of tokens it has generated), so a
// request's tokens do not depend on what else runs), with its log-probability under the model. A
// request ends at a stop token (emitted) or after max_new tokens; its slot and pages are freed for
// the next.
//
// Admission: a request is admitted when a slot is free and the pool has the pages for its whole
// prompt + max_new beyond what the running requests may still take, so an admitted request never
// runs out of cache; a request that could not fit even an empty cache is refused by submit().
// Requests wait in submission order (no later request overtakes one that does not fit yet).
//
// Speculative decoding (a cache made with CacheOptions::speculative; greedy requests; a model
// with its MTP block): the MTP block drafts the token after next, and a step feeds each
// sequence's next token and its draft; the main model's arg max at the next token says whether
// the draft is right, and when it is, its row gives one more token. A step then yields one or two
// tokens per sequence, and they are the tokens plain greedy decoding yields. Prompts are
// prefilled in steps of their own (the MTP rows of a prompt need its first generated token).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "infer/sampling.h"
#include "model/hybrid_model.h"
#include "model/model_cache.h"
#include "ops/token_pick.h"

namespace hlm::infer {

struct Request {
  std::vector<int64_t> prompt;   // >= 1 token ids in [0, vocab)
  int64_t max_new = 16;          // tokens to generate at most (0: only score the prompt)
  SamplingParams sampling;       // greedy by default
  uint64_t stream = 0;           // the Philox stream of its draws (with sampling.seed)
  std::vector<int64_t> stop;     // stop token ids (the stop token is the last one returned)
  bool prompt_logprobs = false;  // also log p(prompt[i + 1] | prompt[0..i])
};

struct Result {
  std::vector<int64_t> tokens;          // generated
  std::vector<double> logprobs;         // of each generated token under the model
  std::vector<double> prompt_logprobs;  // [prompt - 1] when asked
  std::string finish;                   // "stop" or "length"
};

struct TokenEvent {
  int64_t id = 0;     // the request
  int64_t token = 0;  // the token generated; -1: a request with max_new 0 finished (no token)
  double logprob = 0;
  bool last = false;  // the request finished with it
};

class Generator {
 public:
  // The cache lives on the model's device (CPU or CUDA; cache.device is overridden), in the
  // model's compute dtype; tokens are picked where the logits are, and only the picks (and a
  // scored prompt's log-probabilities) cross to the host.
  Generator(const HybridModel& model, const CacheOptions& cache);

  // hlm::Error naming what is wrong with a request: an empty prompt, a token id outside the
  // vocabulary, max_new outside [0, 2^30], bad sampling settings, more tokens than the cache holds.
  void check(const Request& r) const;
  // Checks the request (nothing queued when it is refused) and queues it; returns its id.
  int64_t submit(Request r);
  // One forward over the admitted prompts and the running sequences; the tokens it produced.
  std::vector<TokenEvent> step();
  bool busy() const { return !waiting_.empty() || !running_.empty(); }
  // Drops a waiting or running request (its slot and pages are freed; no result is kept).
  // Returns false when the id is not queued or running.
  bool cancel(int64_t id);
  // Drops every request (after an error, so the generator can go on with new ones).
  void cancel_all();
  // The result of a finished request (once; hlm::Error for an unknown or unfinished id).
  Result take(int64_t id);

  // Checks every request (none is queued when one is refused), steps until all finish, and
  // returns their results in order; on_token sees every token as it comes.
  std::vector<Result> run(const std::vector<Request>& reqs,
                          const std::function<void(const TokenEvent&)>& on_token = {});

  const ModelCache& cache() const { return cache_; }
  int64_t forwards() const { return forwards_; }  // steps that ran a forward
  // Speculative decoding: drafts checked and drafts accepted.
  int64_t drafts() const { return drafts_; }
  int64_t accepted() const { return accepted_; }

 private:
  struct Seq {
    int64_t id = 0;
    Request req;
    int64_t slot = -1;
    bool prefilled = false;
    int64_t next = -1;   // the token to feed next (decode)
    int64_t draft = -1;  // speculative: the MTP block's draft of the token after next
    Result res;
  };
  struct Batch;
  // What sampling reads of a forward's logits rows, computed where the logits are (on the GPU
  // only these cross to the host): each row's picked token, its log-probability and its first
  // non-finite logit (ops::sample_pick), and for the rows of a prompt that is scored the
  // log-probability of the prompt's next token (ops::score_tokens).
  // Each is one device-to-host copy.
  struct Rows {
    std::vector<ops::RowPick> pick;
    std::vector<ops::RowPick> score;  // per row; empty when no row is scored
  };
  // How s's next token is picked: its settings and its draw for this step.
  static ops::SampleRow pick_for(const Seq& s);
  void admit();
  // The forward of a packed batch over the cache, and its logits rows picked by `picks` (one per
  // row) and scored where the batch scores a prompt.
  ModelOutput forward(const Batch& b, bool draft_last, const std::vector<ops::SampleRow>& picks,
                      Rows* rows);
  // Records s's next token, picked from logits row `row`; true when s is finished.
  bool emit(Seq& s, const Rows& rows, int64_t row, std::vector<TokenEvent>& events);
  // After s's prompt ran (its logits rows from `row`): the prompt's log-probabilities when asked,
  // then its first token (or, with max_new 0, its end); true when s is finished.
  bool finish_prefill(Seq& s, const Rows& rows, int64_t row, std::vector<TokenEvent>& events);
  // Closes the finished sequences (finished[i] for running_[i]).
  void retire(const std::vector<bool>& finished);
  std::vector<TokenEvent> step_speculative();
  // The MTP drafts of `seqs` from next tokens and pre-norm rows (per sequence, in order).
  void draft(const std::vector<Seq*>& seqs, const std::vector<std::vector<int64_t>>& next,
             const std::vector<std::vector<int64_t>>& rows, const Tensor& pre_norm);
  int64_t pages_for(int64_t tokens) const;      // pages a sequence of this many tokens takes
  int64_t most_tokens(const Request& r) const;  // cache rows a request may write
  int64_t reserved_pages() const;               // pages the running sequences may still take

  const HybridModel& model_;
  ModelCache cache_;
  int64_t next_id_ = 0, forwards_ = 0, drafts_ = 0, accepted_ = 0;
  std::deque<std::unique_ptr<Seq>> waiting_;
  std::vector<std::unique_ptr<Seq>> running_;
  std::vector<std::pair<int64_t, Result>> done_;
};

}  // namespace hlm::infer
