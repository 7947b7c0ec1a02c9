// Ctrl-C and SIGTERM during training (docs/robustness.md, "Interrupting a run").
//
// While an InterruptGuard lives, the first SIGINT or SIGTERM only records the signal: the trainer
// finishes the step it is in, writes a checkpoint and returns, and the command exits with status
// 128 + the signal's number (130 for SIGINT, 143 for SIGTERM). A second SIGINT or SIGTERM while
// the first is pending restores the default action and re-raises itself: the process ends at
// once (the checkpoint files are written atomically, so the previous checkpoint stays intact).
// The guard restores the previous handlers when it is destroyed. One guard at a time.
#pragma once

namespace hlm::train {

class InterruptGuard {
 public:
  InterruptGuard();
  ~InterruptGuard();
  InterruptGuard(const InterruptGuard&) = delete;
  InterruptGuard& operator=(const InterruptGuard&) = delete;

  // The first signal received while a guard lives (SIGINT or SIGTERM), or 0.
  static int pending();
};

// "SIGINT", "SIGTERM" or "signal N".
const char* signal_name(int sig);

}  // namespace hlm::train
