// Learning-rate schedules (formulas in schedule.h).
#include "train/schedule.h"

#include <fmt/format.h>

#include <cmath>

#include "core/error.h"

namespace hlm::train {

ScheduleKind parse_schedule_kind(std::string_view name) {
  if (name == "cosine") return ScheduleKind::cosine;
  if (name == "constant") return ScheduleKind::constant;
  HLM_FAIL("unknown lr schedule '{}' (expected cosine or constant)", name);
}

const char* schedule_kind_name(ScheduleKind k) {
  return k == ScheduleKind::cosine ? "cosine" : "constant";
}

LrSchedule::LrSchedule(const ScheduleConfig& cfg) : cfg_(cfg) {
  HLM_CHECK(std::isfinite(cfg.lr) && cfg.lr > 0, "lr must be finite and > 0, got {}", cfg.lr);
  HLM_CHECK(cfg.warmup_steps >= 0, "warmup_steps must be >= 0, got {}", cfg.warmup_steps);
  HLM_CHECK(cfg.total_steps >= 1, "total_steps must be >= 1, got {}", cfg.total_steps);
  HLM_CHECK(cfg.warmup_steps <= cfg.total_steps,
            "warmup_steps ({}) must not exceed total_steps ({})", cfg.warmup_steps,
            cfg.total_steps);
  HLM_CHECK(std::isfinite(cfg.min_lr_ratio) && cfg.min_lr_ratio >= 0 && cfg.min_lr_ratio <= 1,
            "min_lr_ratio must be in [0, 1], got {}", cfg.min_lr_ratio);
}

double LrSchedule::at(int64_t step) const {
  HLM_CHECK(step >= 1, "lr schedule: step must be >= 1 (steps are 1-based), got {}", step);
  const double L = cfg_.lr;
  const int64_t W = cfg_.warmup_steps, S = cfg_.total_steps;
  if (step <= W) return L * double(step) / double(W);
  if (cfg_.kind == ScheduleKind::constant) return L;
  const double lo = L * cfg_.min_lr_ratio;
  if (step >= S) return lo;
  const double p = double(step - W) / double(S - W);
  return lo + (L - lo) * (1.0 + std::cos(M_PI * p)) / 2.0;
}

std::string LrSchedule::describe() const {
  if (cfg_.kind == ScheduleKind::constant)
    return fmt::format("constant lr {:g}, {} warmup steps", cfg_.lr, cfg_.warmup_steps);
  return fmt::format("cosine lr {:g} -> {:g} over {} steps, {} warmup steps", cfg_.lr,
                     cfg_.lr * cfg_.min_lr_ratio, cfg_.total_steps, cfg_.warmup_steps);
}

}  // namespace hlm::train
