// The core's defences against careless or hostile input (docs/robustness.md): checked size
// arithmetic, the memory limit, regular-file inputs, output targets that are never a device,
// FIFO or directory, checksums, defined float -> integer conversions and printable messages.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include "core/checksum.h"
#include "core/file_io.h"
#include "core/memory.h"
#include "core/safetensors.h"
#include "core/tensor.h"
#include "testing.h"

namespace hlm {
namespace {

namespace fs = std::filesystem;

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

class CoreHardening : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / fmt::format("hlm_core_{}_{}", ::getpid(), info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& n) const { return (dir_ / n).string(); }
  std::string read(const std::string& p) const {
    std::ifstream f(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  fs::path dir_;
};

// ---- item 2: sizes ---------------------------------------------------------------------------

TEST(CoreSizes, CheckedArithmeticRefusesOverflow) {
  EXPECT_EQ(checked_mul(int64_t(1) << 31, int64_t(1) << 31, "x"), int64_t(1) << 62);
  EXPECT_EQ(checked_add(INT64_MAX - 1, 1, "x"), INT64_MAX);
  EXPECT_THROW(checked_mul(int64_t(1) << 32, int64_t(1) << 31, "x"), Error);
  EXPECT_THROW(checked_add(INT64_MAX, 1, "x"), Error);
  EXPECT_THROW(checked_mul(-1, 2, "x"), Error);
  EXPECT_THROW(checked_mul_u(uint64_t(1) << 32, uint64_t(1) << 32, "x"), Error);
  EXPECT_EQ(checked_mul_u(uint64_t(1) << 32, (uint64_t(1) << 32) - 1, "x"),
            ~uint64_t(0) - ((uint64_t(1) << 32) - 1));
}

TEST(CoreSizes, EmptyRefusesShapesWhoseBytesOverflow) {
  // 2^62 f32 elements: 2^64 bytes, which wrapped to 0 before (an allocation of nothing that
  // constructors then wrote past).
  const std::string m = message_of([] { Tensor::empty({int64_t(1) << 62}, DType::f32); });
  EXPECT_NE(m.find("more than 2^63 bytes"), std::string::npos) << m;
  EXPECT_THROW(Tensor::empty({int64_t(1) << 32, int64_t(1) << 32}, DType::u8), Error);
  EXPECT_THROW(Tensor::zeros({int64_t(1) << 40, int64_t(1) << 40}, DType::f64), Error);
  // Zero elements but strides that would overflow.
  EXPECT_THROW(Tensor::empty({0, int64_t(1) << 40, int64_t(1) << 40}, DType::f32), Error);
  // A legal size still works and its byte count is exact.
  EXPECT_EQ(shape_nbytes({3, 5}, DType::bf16), 30u);
}

TEST(CoreSizes, AnAllocationAboveTheMemoryLimitIsRefusedNamingBothNumbers) {
  // 2^45 bytes (32 TiB): above any machine's memory, so above the limit.
  const std::string m = message_of([] { Tensor::empty({int64_t(1) << 43}, DType::f32); });
  EXPECT_NE(m.find("35184372088832 bytes"), std::string::npos) << m;
  EXPECT_NE(m.find("memory limit of"), std::string::npos) << m;
  EXPECT_GT(memory_limit(), uint64_t(0));
}

TEST(CoreSizes, ByteSizesParse) {
  EXPECT_EQ(parse_byte_size("1073741824", "x"), uint64_t(1) << 30);
  EXPECT_EQ(parse_byte_size("16G", "x"), uint64_t(16) << 30);
  EXPECT_EQ(parse_byte_size("512MiB", "x"), uint64_t(512) << 20);
  EXPECT_EQ(parse_byte_size("2t", "x"), uint64_t(2) << 40);
  for (const char* bad : {"", "G", "12Q", "-5", "1.5G", "99999999999999999999", "16GX", "0"})
    EXPECT_THROW(parse_byte_size(bad, "x"), Error) << bad;
  EXPECT_EQ(format_bytes(1536.0), "1.50 KiB");
}

// ---- float -> integer conversions ------------------------------------------------------------

TEST(CoreSizes, FloatToIntegerConversionsOutsideTheTypeAreErrors) {
  // Truncation toward zero is defined; NaN and values beyond the type have no result.
  EXPECT_EQ(Tensor::from_values({2}, {5.7, -5.7}, DType::f64).to(DType::i64).to_f64_vector(),
            (std::vector<double>{5, -5}));
  for (double bad : {std::nan(""), 1e30, -1e30, std::numeric_limits<double>::infinity()})
    EXPECT_THROW(Tensor::from_values({1}, {bad}, DType::f64).to(DType::i64), Error) << bad;
  EXPECT_THROW(Tensor::from_values({1}, {3e9}, DType::f64).to(DType::i32), Error);
  EXPECT_THROW(Tensor::from_values({1}, {256}, DType::f64).to(DType::u8), Error);
  EXPECT_EQ(Tensor::from_values({1}, {255.9}, DType::f64).to(DType::u8).item(), 255.0);
  // i64 -> i32: -2^32 used to wrap to 0.
  EXPECT_THROW(Tensor::from_vector<int64_t>({1}, {-(int64_t(1) << 32)}).to(DType::i32), Error);
  EXPECT_EQ(Tensor::from_vector<int64_t>({1}, {-7}).to(DType::i32).item(), -7.0);
}

// ---- checksums -------------------------------------------------------------------------------

TEST(CoreChecksum, Crc64MatchesTheCheckValueAndChains) {
  // The catalogued check value of CRC-64/XZ.
  EXPECT_EQ(crc64("123456789", 9), 0x995dc9bbdf1939faull);
  EXPECT_EQ(crc64("", 0), 0u);
  // A bit-at-a-time reference on random data of odd lengths, and chaining.
  Rng rng(testing::test_seed());
  std::vector<uint8_t> d(1000);
  for (auto& b : d) b = uint8_t(rng.below(256));
  auto slow = [](const uint8_t* p, size_t n) {
    uint64_t c = ~uint64_t(0);
    for (size_t i = 0; i < n; ++i) {
      c ^= p[i];
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0xc96c5795d7870f42ull : c >> 1;
    }
    return ~c;
  };
  for (size_t n : {1u, 7u, 8u, 9u, 63u, 1000u}) EXPECT_EQ(crc64(d.data(), n), slow(d.data(), n));
  EXPECT_EQ(crc64(d.data() + 13, 987, crc64(d.data(), 13)), crc64(d.data(), 1000));
  EXPECT_EQ(crc64_hex(0x995dc9bbdf1939faull), "995dc9bbdf1939fa");
}

TEST(CoreChecksum, AFileWrittenByAnotherImplementationOfTheFormatVerifies) {
  // fuzz/corpus/safetensors/*_with_checksum and mixed_dtypes were written by a short Python
  // script from the description in core/safetensors.h (CRC-64/XZ of the data, then of the header
  // without the entry, dumped with sorted keys and no spaces): the two must agree.
  const std::string dir = std::string(HLM_SOURCE_DIR) + "/fuzz/corpus/safetensors/";
  for (const char* name : {"f32_with_checksum", "mixed_dtypes"}) {
    SCOPED_TRACE(name);
    const std::vector<uint8_t> b = read_regular_file(dir + name, "corpus file");
    safetensors::Contents c;
    ASSERT_NO_THROW(c = safetensors::parse(b, name));
    ASSERT_EQ(c.metadata.count(safetensors::kChecksumKey), 1u);
    auto bad = b;
    bad.back() ^= 1;
    EXPECT_THROW(safetensors::parse(bad, name), Error);
  }
}

// ---- printable messages ----------------------------------------------------------------------

TEST(CoreMessages, PrintableEscapesBytesThatAreNotTextButKeepsUtf8) {
  EXPECT_EQ(printable("plain ascii: 12"), "plain ascii: 12");
  EXPECT_EQ(printable("caf\xc3\xa9 \xe2\x82\xac"), "caf\xc3\xa9 \xe2\x82\xac");  // é €
  EXPECT_EQ(printable("a\xff"
                      "b"),
            "a\\xffb");
  EXPECT_EQ(printable("line\nbreak\x1b[31m"), "line\\x0abreak\\x1b[31m");
  EXPECT_EQ(printable("\xc0\xaf"), "\\xc0\\xaf");           // overlong '/'
  EXPECT_EQ(printable("\xed\xa0\x80"), "\\xed\\xa0\\x80");  // a surrogate
  EXPECT_EQ(printable("\xc2\x9b"
                      "x"),
            "\\xc2\\x9bx");                        // C1 control (CSI)
  EXPECT_EQ(printable("\xe2\x82"), "\\xe2\\x82");  // truncated sequence
}

// ---- items 3, 4: inputs ----------------------------------------------------------------------

TEST_F(CoreHardening, InputsMustBeRegularFilesAndNothingBlocks) {
  const std::string fifo = path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const auto t0 = std::chrono::steady_clock::now();
  std::string m = message_of([&] { read_regular_file(fifo, "token file"); });
  EXPECT_NE(m.find("is a FIFO, not a regular file"), std::string::npos) << m;
  m = message_of([&] { safetensors::load(fifo); });
  EXPECT_NE(m.find("is a FIFO"), std::string::npos) << m;
  m = message_of([&] { safetensors::read_header(fifo); });
  EXPECT_NE(m.find("is a FIFO"), std::string::npos) << m;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  m = message_of([&] { safetensors::load(dir_.string()); });
  EXPECT_NE(m.find("is a directory"), std::string::npos) << m;
  m = message_of([&] { read_regular_file("/dev/zero", "data"); });
  EXPECT_NE(m.find("is a character device"), std::string::npos) << m;
  m = message_of([&] { check_regular_input(fifo, "input"); });
  EXPECT_NE(m.find("is a FIFO"), std::string::npos) << m;
  m = message_of([&] { read_regular_file(path("missing"), "data"); });
  EXPECT_NE(m.find("cannot open the file"), std::string::npos) << m;
  std::ofstream(path("f")) << "hello";
  EXPECT_EQ(read_regular_file(path("f"), "x").size(), 5u);
  EXPECT_THROW(read_regular_file(path("f"), "x", 4), Error);
  uint64_t size = 0;
  EXPECT_EQ(read_regular_file_prefix(path("f"), "x", 2, &size).size(), 2u);
  EXPECT_EQ(size, 5u);
}

// ---- item 1: outputs -------------------------------------------------------------------------

TEST_F(CoreHardening, SaveWritesThroughASymlinkAndKeepsIt) {
  safetensors::TensorMap m{{"x", Tensor::from_values({2}, {1, 2}, DType::f32)}};
  fs::create_directories(dir_ / "real");
  std::ofstream(path("real/target.safetensors")) << "old";
  fs::create_symlink("real/target.safetensors", dir_ / "link.safetensors");
  safetensors::save(path("link.safetensors"), m);
  EXPECT_TRUE(fs::is_symlink(dir_ / "link.safetensors"));
  EXPECT_TRUE(testing::bit_equal(safetensors::load(path("real/target.safetensors")).tensors.at("x"),
                                 m.at("x")));
  // A dangling link: its target is created, the link stays.
  fs::create_symlink("real/new.safetensors", dir_ / "dangling");
  safetensors::save(path("dangling"), m);
  EXPECT_TRUE(fs::is_symlink(dir_ / "dangling"));
  EXPECT_TRUE(fs::is_regular_file(dir_ / "real" / "new.safetensors"));
  // No temporary is left beside either.
  for (const auto& e : fs::recursive_directory_iterator(dir_))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
}

TEST_F(CoreHardening, SaveNeverReplacesAFifoDirectoryOrDevice) {
  safetensors::TensorMap m{{"x", Tensor::from_values({2}, {1, 2}, DType::f32)}};
  const std::string fifo = path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::string e = message_of([&] { safetensors::save(fifo, m); });
  EXPECT_NE(e.find("is a FIFO"), std::string::npos) << e;
  EXPECT_EQ(file_kind(fifo), "a FIFO");
  fs::create_directories(dir_ / "d");
  e = message_of([&] { safetensors::save(path("d"), m); });
  EXPECT_NE(e.find("is a directory"), std::string::npos) << e;
  EXPECT_TRUE(fs::is_directory(dir_ / "d"));
  // A link to a FIFO is refused too (the target is what counts).
  fs::create_symlink(fifo, dir_ / "to_fifo");
  EXPECT_THROW(safetensors::save(path("to_fifo"), m), Error);
  EXPECT_EQ(file_kind(fifo), "a FIFO");
  // A file under a regular file, a missing directory.
  std::ofstream(path("plain")) << "x";
  e = message_of([&] { safetensors::save(path("plain/out.safetensors"), m); });
  EXPECT_NE(e.find("is a regular file, not a directory"), std::string::npos) << e;
  e = message_of([&] { safetensors::save(path("nowhere/out.safetensors"), m); });
  EXPECT_NE(e.find("does not exist"), std::string::npos) << e;
  if (::geteuid() == 0) {
    // As root the rename would replace a device node: a private copy of /dev/null's node.
    const std::string dev = path("null");
    ASSERT_EQ(::mknod(dev.c_str(), S_IFCHR | 0666, makedev(1, 3)), 0);
    e = message_of([&] { safetensors::save(dev, m); });
    EXPECT_NE(e.find("is a character device"), std::string::npos) << e;
    EXPECT_EQ(file_kind(dev), "a character device");
  }
  for (const auto& p : fs::directory_iterator(dir_))
    EXPECT_EQ(p.path().filename().string().find(".tmp."), std::string::npos) << p.path();
}

}  // namespace
}  // namespace hlm
