#include "core/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "core/memory.h"

namespace hlm {
namespace fs = std::filesystem;

namespace {

std::string kind_of_mode(mode_t m) {
  if (S_ISREG(m)) return "a regular file";
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISLNK(m)) return "a symbolic link";
  return "not a regular file";
}

std::string errno_text(int e) {
  return std::strerror(e);
}

// Follows the symbolic links of the last component of `p` (the directories above are resolved by
// realpath later): the path of the first thing that is not a link, which may not exist.
std::string follow_links(const std::string& path, const std::string& what) {
  std::string p = path;
  for (int hop = 0;; ++hop) {
    struct stat st;
    if (::lstat(p.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return p;
    HLM_CHECK(hop < 40, "{} '{}': too many levels of symbolic links", what, path);
    std::string buf(PATH_MAX, '\0');
    const ssize_t n = ::readlink(p.c_str(), buf.data(), buf.size());
    HLM_CHECK(n >= 0, "{} '{}': cannot read the symbolic link '{}': {}", what, path, p,
              errno_text(errno));
    buf.resize(size_t(n));
    const fs::path target(buf);
    p = target.is_absolute() ? target.string() : (fs::path(p).parent_path() / target).string();
  }
}

}  // namespace

std::string file_kind(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return "missing";
  return kind_of_mode(st.st_mode);
}

void check_regular_input(const std::string& path, const std::string& what) {
  struct stat st;
  HLM_CHECK(!path.empty(), "{}: the path is empty", what);
  HLM_CHECK(::stat(path.c_str(), &st) == 0, "{} '{}': cannot open the file: {}", what, path,
            errno_text(errno));
  HLM_CHECK(S_ISREG(st.st_mode), "{} '{}' is {}, not a regular file", what, path,
            kind_of_mode(st.st_mode));
}

namespace {

// Opens `path` for reading without blocking and checks it is a regular file; returns the
// descriptor and its size.
int open_regular(const std::string& path, const std::string& what, uint64_t* size) {
  HLM_CHECK(!path.empty(), "{}: the path is empty", what);
  // O_NONBLOCK: opening a FIFO without a writer must not wait for one; the type is checked on
  // the open descriptor, so nothing can swap the file in between.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  HLM_CHECK(fd >= 0, "{} '{}': cannot open the file: {}", what, path, errno_text(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    HLM_FAIL("{} '{}': cannot stat the file: {}", what, path, errno_text(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    HLM_FAIL("{} '{}' is {}, not a regular file", what, path, kind_of_mode(st.st_mode));
  }
  // Back to blocking reads (a regular file never blocks long; this keeps EAGAIN out of reads).
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  *size = uint64_t(st.st_size);
  return fd;
}

std::vector<uint8_t> read_fd(int fd, const std::string& path, const std::string& what, uint64_t n) {
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  std::vector<uint8_t> bytes(static_cast<size_t>(n));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t r = ::pread(fd, bytes.data() + done, bytes.size() - done, off_t(done));
    if (r < 0 && errno == EINTR) continue;
    HLM_CHECK(r >= 0, "{} '{}': read error after {} of {} bytes: {}", what, path, done, n,
              errno_text(errno));
    HLM_CHECK(r > 0, "{} '{}': the file shrank while it was read ({} of {} bytes)", what, path,
              done, n);
    done += size_t(r);
  }
  return bytes;
}

}  // namespace

RegularFile::RegularFile(const std::string& path, const std::string& what)
    : path_(path), what_(what) {
  uint64_t size = 0;
  fd_ = open_regular(path, what, &size);
  size_ = size;
}

RegularFile::~RegularFile() {
  if (fd_ >= 0) ::close(fd_);
}

void RegularFile::read_at(uint64_t offset, void* dst, uint64_t n) const {
  auto* out = static_cast<uint8_t*>(dst);
  uint64_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd_, out + done, size_t(n - done), off_t(offset + done));
    if (r < 0 && errno == EINTR) continue;
    HLM_CHECK(r >= 0, "{} '{}': read error at offset {}: {}", what_, path_, offset + done,
              errno_text(errno));
    HLM_CHECK(r > 0, "{} '{}': the file ends at {} bytes, {} were expected", what_, path_,
              offset + done, offset + n);
    done += uint64_t(r);
  }
}

std::vector<uint8_t> read_regular_file(const std::string& path, const std::string& what,
                                       uint64_t max_bytes) {
  uint64_t size = 0;
  const int fd = open_regular(path, what, &size);
  try {
    if (max_bytes > 0)
      HLM_CHECK(size <= max_bytes, "{} '{}' has {} bytes, more than the {} this input may have",
                what, path, size, max_bytes);
    else
      check_memory(size, fmt::format("reading {} '{}'", what, path));
  } catch (...) {
    ::close(fd);
    throw;
  }
  return read_fd(fd, path, what, size);
}

std::vector<uint8_t> read_regular_file_prefix(const std::string& path, const std::string& what,
                                              uint64_t n, uint64_t* file_size) {
  uint64_t size = 0;
  const int fd = open_regular(path, what, &size);
  if (file_size) *file_size = size;
  return read_fd(fd, path, what, n < size ? n : size);
}

std::string resolve_output_path(const std::string& path, const std::string& what) {
  HLM_CHECK(!path.empty(), "{}: the output path is empty", what);
  const std::string target = follow_links(path, what);
  const fs::path t(target);
  HLM_CHECK(t.has_filename() && t.filename() != "." && t.filename() != "..",
            "{} '{}' names a directory, not a file", what, path);
  const std::string parent = t.parent_path().empty() ? "." : t.parent_path().string();
  struct stat pst;
  HLM_CHECK(::stat(parent.c_str(), &pst) == 0, "{} '{}': the directory '{}' does not exist", what,
            path, parent);
  HLM_CHECK(S_ISDIR(pst.st_mode), "{} '{}': '{}' is {}, not a directory", what, path, parent,
            kind_of_mode(pst.st_mode));
  char* real = ::realpath(parent.c_str(), nullptr);
  HLM_CHECK(real != nullptr, "{} '{}': cannot resolve the directory '{}': {}", what, path, parent,
            errno_text(errno));
  const std::string resolved = (fs::path(real) / t.filename()).string();
  std::free(real);
  check_output_target(resolved, what + " '" + path + "'");
  return resolved;
}

void check_output_target(const std::string& resolved, const std::string& what) {
  struct stat st;
  if (::lstat(resolved.c_str(), &st) != 0) return;  // absent: created
  HLM_CHECK(S_ISREG(st.st_mode),
            "{}: '{}' is {}; only a regular file (or a new name) is replaced by an output", what,
            resolved, kind_of_mode(st.st_mode));
}

void write_file_replacing(const std::string& resolved, const std::vector<uint8_t>& bytes,
                          const std::string& what) {
  static std::atomic<uint64_t> counter{0};
  const fs::path target(resolved);
  const std::string tmp =
      (target.parent_path() /
       fmt::format(".{}.tmp.{}.{}", target.filename().string(), ::getpid(), counter.fetch_add(1)))
          .string();
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  HLM_CHECK(fd >= 0, "{}: cannot create the temporary file '{}': {}", what, tmp, errno_text(errno));
  auto fail = [&](const std::string& msg) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw Error(msg);
  };
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0)
      fail(fmt::format("{}: error writing '{}' ({} of {} bytes written): {}", what, tmp, done,
                       bytes.size(), w < 0 ? errno_text(errno) : "no progress"));
    done += size_t(w);
  }
  if (::fsync(fd) != 0)
    fail(fmt::format("{}: fsync of '{}' failed: {}", what, tmp, errno_text(errno)));
  if (::close(fd) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    HLM_FAIL("{}: closing '{}' failed: {}", what, tmp, errno_text(e));
  }
  try {
    check_output_target(resolved, what);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  if (::rename(tmp.c_str(), resolved.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    HLM_FAIL("{}: cannot rename '{}' to '{}': {}", what, tmp, resolved, errno_text(e));
  }
  const int dfd = ::open(target.parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);  // some file systems refuse (EINVAL): the rename is done all the same
    ::close(dfd);
  }
}

}  // namespace hlm
