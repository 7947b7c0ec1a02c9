// Files the library reads and writes on a user's behalf, checked before anything is read or
// replaced (docs/robustness.md):
//   - an input must be a regular file: a directory, FIFO, socket or device is refused with an
//     hlm::Error naming the path and what it is, without blocking (a FIFO is opened non-blocking
//     and never read), and a file larger than the memory limit (core/memory.h) is refused before
//     it is read;
//   - an output path is resolved through its symbolic links to the file it names; that file must
//     be a regular file or not exist yet, and its directory must exist. A device, FIFO, socket
//     or directory is never replaced, and a symbolic link given as the output stays a link (the
//     file it points to is replaced).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hlm {

// "a directory", "a FIFO", "a character device", "a block device", "a socket", "a regular file",
// "a symbolic link" for what lstat() finds at `path`, "missing" when nothing is there.
std::string file_kind(const std::string& path);

// Throws hlm::Error ("<what> '<path>': ...") unless `path` names an existing regular file (after
// symbolic links). Never blocks.
void check_regular_input(const std::string& path, const std::string& what);

// The whole content of the regular file `path` (checked as above; refused when larger than
// `max_bytes`, or than the memory limit when max_bytes is 0).
std::vector<uint8_t> read_regular_file(const std::string& path, const std::string& what,
                                       uint64_t max_bytes = 0);

// A regular file open for reading (checked as above, never blocking on a FIFO): reads at given
// offsets, so a large file is read piece by piece. Closed when destroyed.
class RegularFile {
 public:
  RegularFile(const std::string& path, const std::string& what);
  ~RegularFile();
  RegularFile(const RegularFile&) = delete;
  RegularFile& operator=(const RegularFile&) = delete;
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // Exactly n bytes at `offset` into dst; hlm::Error naming the file on a read error or when the
  // file ends first.
  void read_at(uint64_t offset, void* dst, uint64_t n) const;

 private:
  std::string path_, what_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// The first min(size, n) bytes of the regular file `path` (checked as above); *file_size receives
// its size.
std::vector<uint8_t> read_regular_file_prefix(const std::string& path, const std::string& what,
                                              uint64_t n, uint64_t* file_size);

// The path an output written to `path` replaces: symbolic links followed (also a dangling one:
// its target is created), the directory part made absolute. Throws hlm::Error naming the path
// when the target exists and is not a regular file, or when its directory does not exist or is
// not a directory.
std::string resolve_output_path(const std::string& path, const std::string& what);

// Throws hlm::Error unless the file at `resolved` (from resolve_output_path) is still absent or a
// regular file: checked again right before a rename replaces it.
void check_output_target(const std::string& resolved, const std::string& what);

// Writes `bytes` to a new temporary file in the directory of `resolved` (from
// resolve_output_path), fsyncs it, checks the target again (check_output_target) and renames the
// temporary over it, then fsyncs the directory. On any failure the temporary is removed and the
// target is untouched; errors name `what`.
void write_file_replacing(const std::string& resolved, const std::vector<uint8_t>& bytes,
                          const std::string& what);

}  // namespace hlm
