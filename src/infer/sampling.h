// Choosing the next token from a row of logits: greedy, temperature, top-k and top-p (nucleus)
// sampling, reproducible from a seed, with the chosen token's log-probability under the model.
//
//   p_v      = softmax(logits)_v                          the model's distribution (FP64)
//   logprob  = log p_token                                 reported whatever the sampling settings
//   greedy (temperature == 0): the largest logit, ties to the lowest id
//   otherwise, in this order (transformers' order of logits processors):
//     q_v  = softmax(logits / temperature)_v
//     top-k: keep the k largest q (ties to the lower id), 0 = all
//     top-p: of those, in decreasing q (ties: lower id first), keep the shortest prefix whose sum
//            reaches top_p times their total (at least one token), 1 = all
//     draw u in [0, 1) and take the first kept token (same order) whose running sum of q exceeds
//            u times the kept total
// The draw for a sequence's step comes from Philox at (seed, stream = the sequence's id, counter =
// the step), so a sequence samples the same tokens whatever else shares its batch, and a run
// repeats bit for bit.
#pragma once

#include <cstdint>
#include <string>

namespace hlm::infer {

struct SamplingParams {
  double temperature = 0.0;  // 0: greedy; else > 0 and finite
  int64_t top_k = 0;         // 0: off; else >= 1
  double top_p = 1.0;        // in (0, 1]; 1: off
  uint64_t seed = 0;
  // hlm::Error naming the first bad field.
  void validate() const;
  bool greedy() const { return temperature == 0.0; }
};

struct Sampled {
  int64_t token = -1;
  double logprob = 0;  // log p_token under softmax(logits) (no temperature, no truncation)
};

// The next token for sequence `stream` at step `step` from logits[0 .. V) (V >= 1, finite values;
// an Inf or NaN logit is an error naming its id).
Sampled sample_token(const float* logits, int64_t V, const SamplingParams& p, uint64_t stream,
                     uint64_t step);

// The draw u in [0, 1) of sequence `stream` at step `step` under `seed` (sample_token's; the
// device-side pick, ops::sample_pick, takes it as SampleRow::u).
double draw(uint64_t seed, uint64_t stream, uint64_t step);

}  // namespace hlm::infer
