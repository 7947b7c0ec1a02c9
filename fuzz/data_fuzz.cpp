// libFuzzer target: the training data readers (`--data`: UTF-8 text as byte tokens, or a .bin of
// little-endian uint32 ids). The first four input bytes choose the reader and its settings
// (tokens per step, window length, shuffle, vocabulary); the rest is the file, given to the
// reader through a memfd (a regular file in memory). Opening must succeed or raise hlm::Error;
// every batch an opened stream gives must pass check_batch. Anything else is a bug.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "train/data.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  const bool bin = data[0] & 1;
  hlm::train::TokenStreamConfig cfg;
  cfg.tokens_per_step = 1 + data[1] % 64;
  cfg.seq_len = data[2] % 4 == 0 ? 0 : 1 + data[2] % 32;
  cfg.shuffle = data[0] & 2;
  cfg.seed = data[3];
  const int64_t vocab = bin ? 2 + data[3] % 300 : hlm::train::kByteVocab;
  const int fd = ::memfd_create("hlm_fuzz_data", MFD_CLOEXEC);
  if (fd < 0) std::abort();
  size_t done = 0;
  while (done < size - 4) {
    const ssize_t w = ::write(fd, data + 4 + done, size - 4 - done);
    if (w <= 0) std::abort();
    done += size_t(w);
  }
  const std::string file = "/proc/self/fd/" + std::to_string(fd);  // the memfd itself
  try {
    auto s =
        bin ? hlm::train::open_bin_file(file, vocab, cfg) : hlm::train::open_text_file(file, cfg);
    for (int64_t step : {int64_t(0), int64_t(1), int64_t(2), int64_t(data[1]) * 977})
      hlm::train::check_batch(s->batch(step), s->vocab_size());
    for (int64_t k = 0; k < 8; ++k) {
      const int64_t w = s->window_of_draw(k);
      if (w < 0 || w >= s->num_windows()) std::abort();
    }
  } catch (const hlm::Error&) {
  }
  ::close(fd);
  return 0;
}
