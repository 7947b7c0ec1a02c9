#include "train/schedule.h"

#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"

namespace hlm::train {
namespace {

TEST(Schedule, CosineWarmupAndDecayValues) {
  // Peak 1e-3, 10 warmup steps, 110 steps, floor 1e-4.
  LrSchedule s({ScheduleKind::cosine, 1e-3, 10, 110, 0.1});
  EXPECT_DOUBLE_EQ(s.at(1), 1e-4);   // warmup start: L / W
  EXPECT_DOUBLE_EQ(s.at(5), 5e-4);   // warmup middle
  EXPECT_DOUBLE_EQ(s.at(10), 1e-3);  // warmup end: the peak
  // Decay: p = (s - 10) / 100.
  EXPECT_NEAR(s.at(35), 1e-4 + 9e-4 * (1 + std::sqrt(0.5)) / 2, 1e-18);  // p = 1/4
  EXPECT_NEAR(s.at(60), 5.5e-4, 1e-18);                                  // p = 1/2
  EXPECT_NEAR(s.at(85), 1e-4 + 9e-4 * (1 - std::sqrt(0.5)) / 2, 1e-18);  // p = 3/4
  EXPECT_EQ(s.at(110), 1e-3 * 0.1);                                      // the end: L * r
  EXPECT_EQ(s.at(111), 1e-3 * 0.1);                                      // past the end
  EXPECT_EQ(s.at(100000), 1e-3 * 0.1);
  // Monotone: up during warmup, down after.
  for (int64_t k = 1; k < 10; ++k) EXPECT_LT(s.at(k), s.at(k + 1));
  for (int64_t k = 10; k < 110; ++k) EXPECT_GT(s.at(k), s.at(k + 1));
  // Continuous at the warmup boundary: the first decay step is within one step's slope.
  EXPECT_NEAR(s.at(11), 1e-3, 1e-3 * 1e-3);
}

TEST(Schedule, NoWarmupAndZeroFloor) {
  LrSchedule s({ScheduleKind::cosine, 2.0, 0, 4, 0.0});
  EXPECT_NEAR(s.at(1), 1.0 + std::sqrt(0.5), 1e-15);  // p = 1/4: 2 (1 + cos(pi/4)) / 2
  EXPECT_NEAR(s.at(2), 1.0, 1e-15);
  EXPECT_NEAR(s.at(3), 1.0 - std::sqrt(0.5), 1e-15);
  EXPECT_EQ(s.at(4), 0.0);
}

TEST(Schedule, ConstantWithWarmup) {
  LrSchedule s({ScheduleKind::constant, 3e-4, 4, 100, 0.1});
  EXPECT_DOUBLE_EQ(s.at(1), 0.75e-4);
  EXPECT_DOUBLE_EQ(s.at(2), 1.5e-4);
  EXPECT_DOUBLE_EQ(s.at(4), 3e-4);
  EXPECT_EQ(s.at(5), 3e-4);
  EXPECT_EQ(s.at(100), 3e-4);
  EXPECT_EQ(s.at(1000), 3e-4);  // min_lr_ratio does not apply
  LrSchedule flat({ScheduleKind::constant, 1e-2, 0, 1, 0.0});
  EXPECT_EQ(flat.at(1), 1e-2);
}

TEST(Schedule, WarmupAsLongAsTheRun) {
  LrSchedule s({ScheduleKind::cosine, 1.0, 8, 8, 0.25});
  EXPECT_EQ(s.at(2), 0.25);
  EXPECT_EQ(s.at(8), 1.0);
  EXPECT_EQ(s.at(9), 0.25);  // past the end: the floor
}

TEST(Schedule, RejectsBadConfigAndSteps) {
  auto bad = [](ScheduleConfig c) { EXPECT_THROW(LrSchedule{c}, Error); };
  bad({ScheduleKind::cosine, 0.0, 0, 10, 0.1});
  bad({ScheduleKind::cosine, NAN, 0, 10, 0.1});
  bad({ScheduleKind::cosine, 1e-3, -1, 10, 0.1});
  bad({ScheduleKind::cosine, 1e-3, 11, 10, 0.1});
  bad({ScheduleKind::cosine, 1e-3, 0, 0, 0.1});
  bad({ScheduleKind::cosine, 1e-3, 0, 10, 1.5});
  bad({ScheduleKind::cosine, 1e-3, 0, 10, -0.1});
  LrSchedule s({ScheduleKind::cosine, 1e-3, 0, 10, 0.1});
  EXPECT_THROW(s.at(0), Error);
  EXPECT_EQ(parse_schedule_kind("cosine"), ScheduleKind::cosine);
  EXPECT_EQ(parse_schedule_kind("constant"), ScheduleKind::constant);
  EXPECT_THROW(parse_schedule_kind("linear"), Error);
  EXPECT_STREQ(schedule_kind_name(ScheduleKind::constant), "constant");
  EXPECT_NE(s.describe().find("cosine"), std::string::npos);
}

}  // namespace
}  // namespace hlm::train
