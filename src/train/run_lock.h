// The exclusive lock of a run directory (docs/robustness.md, "One run per directory").
//
// A training run holds an flock() on DIR/.hybridlm.lock from before it reads or writes anything
// in DIR until it ends; the file holds the holder's process id. A second run on the same
// directory (a fresh one, an --overwrite or a --resume) is refused with an hlm::Error naming the
// holder's pid. The kernel drops the lock when the holder exits, however it ends, so a stale
// lock file never blocks a later run; the file itself stays (removing it would race with a
// starting run).
#pragma once

#include <string>

namespace hlm::train {

inline constexpr const char* kLockFile = ".hybridlm.lock";

class RunLock {
 public:
  // Takes the lock of `dir` (which must exist) without waiting; hlm::Error when another process
  // holds it.
  explicit RunLock(const std::string& dir);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

  // The pid recorded in DIR/.hybridlm.lock (0 when none can be read).
  static long holder(const std::string& dir);
  // Throws the same hlm::Error as the constructor when another process holds the lock of `dir`;
  // takes nothing (for readers such as read_trainer_checkpoint).
  // A lock this process holds itself passes.
  static void check_free(const std::string& dir);

 private:
  int fd_ = -1;
  std::string dir_;  // canonical
};

}  // namespace hlm::train
