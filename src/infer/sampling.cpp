#include "infer/sampling.h"

#include <cmath>

#include "core/error.h"
#include "core/rng.h"
#include "ops/token_pick.h"

namespace hlm::infer {

void SamplingParams::validate() const {
  HLM_CHECK(std::isfinite(temperature) && temperature >= 0,
            "sampling: temperature must be 0 (greedy) or a finite positive number, got {}",
            temperature);
  HLM_CHECK(top_k >= 0, "sampling: top_k must be 0 (off) or >= 1, got {}", top_k);
  HLM_CHECK(std::isfinite(top_p) && top_p > 0 && top_p <= 1,
            "sampling: top_p must be in (0, 1], got {}", top_p);
}

Sampled sample_token(const float* logits, int64_t V, const SamplingParams& p, uint64_t stream,
                     uint64_t step) {
  p.validate();
  HLM_CHECK(V >= 1, "sampling: the vocabulary is empty");
  ops::SampleRow row{p.temperature, p.top_k, p.top_p, 0.0};
  if (!p.greedy()) row.u = draw(p.seed, stream, step);
  const ops::RowPick k = ops::pick_host_row(logits, V, row);
  HLM_CHECK(k.bad < 0, "sampling: logit {} of token {} is not finite", logits[k.bad], k.bad);
  return {k.token, k.logprob};
}

double draw(uint64_t seed, uint64_t stream, uint64_t step) {
  Rng rng(seed, stream);
  rng.set_counter(step);
  return rng.uniform();
}

}  // namespace hlm::infer
