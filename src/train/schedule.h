// Learning-rate schedules. Steps are 1-based: step s is the s-th optimizer update (the one the
// metrics line "step": s reports, and the value AdamW's step_count() has after it). With peak lr L,
// warmup W >= 0 steps, total S >= max(W, 1) steps and min_lr_ratio r in [0, 1]:
//
//   warmup (both kinds), 1 <= s <= W:   lr(s) = L * s / W
//   cosine, W < s <= S:                 p = (s - W) / (S - W)
//                                       lr(s) = L * r + (L - L * r) * (1 + cos(pi * p)) / 2
//   cosine, s > S:                      lr(s) = L * r
//   constant, s > W:                    lr(s) = L
//
// So the first update already moves (L / W), step W runs at the peak, the cosine is continuous at
// W and the last step S runs at exactly L * r.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace hlm::train {

enum class ScheduleKind { cosine, constant };
ScheduleKind parse_schedule_kind(std::string_view name);  // "cosine" | "constant"
const char* schedule_kind_name(ScheduleKind k);

struct ScheduleConfig {
  ScheduleKind kind = ScheduleKind::cosine;
  double lr = 3e-4;           // peak learning rate L
  int64_t warmup_steps = 0;   // W
  int64_t total_steps = 1;    // S (the cosine reaches L * min_lr_ratio at S)
  double min_lr_ratio = 0.1;  // r
};

class LrSchedule {
 public:
  // Validates the configuration (hlm::Error naming the field).
  explicit LrSchedule(const ScheduleConfig& cfg);
  const ScheduleConfig& config() const { return cfg_; }
  // The learning rate of update `step` (>= 1).
  double at(int64_t step) const;
  std::string describe() const;

 private:
  ScheduleConfig cfg_;
};

}  // namespace hlm::train
