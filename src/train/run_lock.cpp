#include "train/run_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <set>
#include <string>

#include "core/error.h"

namespace hlm::train {

namespace {
std::string lock_path(const std::string& dir) {
  return (std::filesystem::path(dir) / kLockFile).string();
}
}  // namespace

namespace {
// The directories this process holds locks of (canonical paths): its own readers pass.
std::mutex g_mu;
std::set<std::string> g_held;
std::string canonical_dir(const std::string& dir) {
  std::error_code ec;
  const auto p = std::filesystem::canonical(dir, ec);
  return ec ? dir : p.string();
}

[[noreturn]] void in_use(const std::string& dir, const std::string& path) {
  const long pid = RunLock::holder(dir);
  HLM_FAIL(
      "run directory '{}' is in use by another training run ({}; lock file {}): wait for it to "
      "end or stop it, or choose another --out",
      dir, pid > 0 ? fmt::format("process {}", pid) : std::string("process id unknown"), path);
}
}  // namespace

void RunLock::check_free(const std::string& dir) {
  {
    std::lock_guard<std::mutex> g(g_mu);
    if (g_held.count(canonical_dir(dir))) return;
  }
  const std::string path = lock_path(dir);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return;  // no lock file: no run has started there
  const bool busy = ::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  ::close(fd);  // releases the probe's lock when it got one
  if (busy) in_use(dir, path);
}

RunLock::RunLock(const std::string& dir) {
  const std::string path = lock_path(dir);
  // O_NOFOLLOW: a symbolic link planted as the lock file is refused, not followed.
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  HLM_CHECK(fd_ >= 0, "run directory '{}': cannot open its lock file '{}': {}", dir, path,
            std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    ::close(fd_);
    fd_ = -1;
    if (e == EWOULDBLOCK) in_use(dir, path);
    HLM_FAIL("run directory '{}': cannot lock '{}': {}", dir, path, std::strerror(e));
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) != ssize_t(pid.size())) {
    const int e = errno;
    ::close(fd_);
    fd_ = -1;
    HLM_FAIL("run directory '{}': cannot write its lock file '{}': {}", dir, path,
             std::strerror(e));
  }
  dir_ = canonical_dir(dir);
  std::lock_guard<std::mutex> g(g_mu);
  g_held.insert(dir_);
}

RunLock::~RunLock() {
  if (fd_ < 0) return;
  {
    std::lock_guard<std::mutex> g(g_mu);
    g_held.erase(dir_);
  }
  ::close(fd_);  // releases the flock
}

long RunLock::holder(const std::string& dir) {
  const int fd = ::open(lock_path(dir).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return 0;
  char buf[32] = {};
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return 0;
  char* end = nullptr;
  const long pid = std::strtol(buf, &end, 10);
  return pid > 0 ? pid : 0;
}

}  // namespace hlm::train
