// The next token of every row of logits, picked where the logits are (a decode step's sampling:
// only the choices cross to the host, not the [R, V] logits).
//
// greedy_pick: every row greedy.
//   token_r   = the largest logit of row r, ties to the lowest id
//   logprob_r = x_{r, token} - (m + log sum_v exp(x_{r,v} - m)),  m = x_{r, token}     in FP64
//   bad_r     = the first id whose logit is NaN or infinite, -1 when none (then token and logprob
//               are meaningless: the caller reports the bad logit)
// sample_pick: row r greedy when rows[r].temperature is 0, else sampled (infer/sampling.h's rule,
// the order of transformers' logits processors):
//   q_v    = softmax(x_r / temperature)_v
//   top-k  keep the k largest q (ties: the lower id), 0 = all
//   top-p  of those, in decreasing q (ties: lower id first), keep the shortest prefix whose sum
//          reaches top_p times their total (at least one token), 1 = all
//   draw   take the first kept token (same order) whose running sum of q exceeds u times the kept
//          total, u = rows[r].u in [0, 1) (the caller's random draw)
//   logprob_r and bad_r as above: the log-probability under softmax(x_r), whatever the settings.
//
// The CPU sums each row in id order for the log-probability and, for a sampled row, sorts the
// candidates and sums their weights in FP64 in that order (infer::sample_token's bits). CUDA sums
// the log-probability in a fixed tree (one block per row), and selects by radix over the order
// (logit, then id) with the weights q rounded to integers (2^-s of the largest, s = min(52, 62 -
// bits(V)): 2^-44 at V = 154880) and summed exactly: its choices equal the CPU's except where u
// falls within that rounding of a boundary between two tokens.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace hlm::ops {

// One row's pick on the host.
struct RowPick {
  int64_t token = 0;
  double logprob = 0;
  int64_t bad = -1;  // the first non-finite logit's id, or -1 (then token and logprob are 0)
};

// The three outputs are views of one [3, R] buffer, so the host reads a pick in one copy.
struct TokenPick {
  Tensor token;    // [R] i64
  Tensor logprob;  // [R] f64
  Tensor bad;      // [R] i64
  Tensor packed;   // [3, R] i64: token, logprob's bits, bad
  // Every row's pick on the host (one device-to-host copy).
  std::vector<RowPick> to_host() const;
};

// One row's sampling settings (infer::SamplingParams with the draw).
struct SampleRow {
  double temperature = 0;  // 0: greedy; else > 0 and finite
  int64_t top_k = 0;       // 0: off; else >= 1
  double top_p = 1;        // in (0, 1]
  double u = 0;            // in [0, 1)
};

// logits [R, V] (V >= 1): f32 or f64 on the CPU, also bf16 on CUDA. Outputs on the logits' device.
TokenPick greedy_pick(const Tensor& logits);
// As greedy_pick, row r picked by rows[r] (rows.size() == R; a bad setting is an error naming
// the row).
TokenPick sample_pick(const Tensor& logits, const std::vector<SampleRow>& rows);
// The log-probability of a given token per row (a prompt's scores): token_r = tokens[r] (in
// [0, V)), logprob_r = x_{r, token} - (m + log sum_v exp(x_{r,v} - m)) in FP64 with m the row's
// largest logit, bad_r as above.
TokenPick score_tokens(const Tensor& logits, const std::vector<int64_t>& tokens);
// sample_pick of one host row x[0 .. V) (V >= 1; p checked by the caller): the CPU op's bits
// (infer::sample_token).
RowPick pick_host_row(const float* x, int64_t V, const SampleRow& p);

}  // namespace hlm::ops
