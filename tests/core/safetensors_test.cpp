#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/safetensors.h"
#include "testing.h"

namespace hlm {
namespace {

std::vector<uint8_t> file_of(const std::string& header, size_t data_bytes) {
  std::vector<uint8_t> b(8 + header.size() + data_bytes, 0);
  for (int i = 0; i < 8; ++i) b[size_t(i)] = uint8_t(uint64_t(header.size()) >> (8 * i));
  std::memcpy(b.data() + 8, header.data(), header.size());
  return b;
}

TEST(CoreSafetensors, RoundTripEveryDtype) {
  Rng rng(testing::test_seed());
  safetensors::TensorMap m;
  for (DType dt : {DType::f64, DType::f32, DType::bf16, DType::f16, DType::e4m3, DType::e5m2})
    m[std::string("t_") + dtype_name(dt)] = randn({3, 5}, dt, rng);
  m["ids64"] = Tensor::from_values({4}, {0, -1, 5, 1e12}, DType::i64);
  m["ids32"] = Tensor::from_values({2, 2}, {1, 2, 3, -4}, DType::i32);
  m["bytes"] = Tensor::from_values({3}, {0, 7, 255}, DType::u8);
  m["scalar"] = Tensor::scalar(0.125, DType::f64);
  m["empty"] = Tensor::empty({0, 4}, DType::f32);
  const std::string path = ::testing::TempDir() + "/rt.safetensors";
  safetensors::save(path, m, {{"format", "pt"}});
  auto c = safetensors::load(path);
  EXPECT_EQ(c.metadata.at("format"), "pt");
  ASSERT_EQ(c.tensors.size(), m.size());
  for (auto& [name, t] : m) {
    const Tensor& u = c.tensors.at(name);
    EXPECT_EQ(u.dtype(), t.dtype()) << name;
    EXPECT_TRUE(testing::bit_equal(u, t)) << name;
  }
  // The data buffer starts 8-byte aligned and the header is valid JSON the reference accepts.
  std::ifstream f(path, std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp." + std::to_string(::getpid())));
}

TEST(CoreSafetensors, KnownFileLayoutParses) {
  // A file as the reference writer lays it out: two f32 values then one bf16.
  const std::string h = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                        R"("b":{"dtype":"BF16","shape":[1],"data_offsets":[8,10]}})";
  auto bytes = file_of(h, 10);
  const float a[2] = {1.5f, -2.0f};
  std::memcpy(bytes.data() + 8 + h.size(), a, 8);
  bytes[8 + h.size() + 8] = 0x80, bytes[8 + h.size() + 9] = 0x3f;  // bf16 1.0
  auto c = safetensors::parse(bytes, "mem");
  EXPECT_EQ(c.tensors.at("a").to_f64_vector(), (std::vector<double>{1.5, -2.0}));
  EXPECT_EQ(c.tensors.at("b").item(), 1.0);
}

TEST(CoreSafetensors, MalformedFilesGiveErrorsNotCrashes) {
  auto bad = [](const std::vector<uint8_t>& b) {
    EXPECT_THROW(safetensors::parse(b, "bad"), Error);
  };
  bad({1, 2, 3});                                                                 // too short
  bad(file_of("{", 0));                                                           // bad JSON
  bad(file_of("[1]", 0));                                                         // not object
  bad(file_of(R"({"a":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}})", 1));    // dtype
  bad(file_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4));   // size
  bad(file_of(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 2));   // past end
  bad(file_of(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", 4));   // reversed
  bad(file_of(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4));  // negative
  bad(file_of(R"({"a":{"dtype":"F32","shape":[1]}})", 4));                        // no offsets
  bad(file_of(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
              R"("b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})",
              4));  // overlap
  bad(file_of(R"({"a":{"dtype":"F32","shape":[1099511627776,1099511627776],)"
              R"("data_offsets":[0,4]}})",
              4));  // overflowing shape
  auto huge = file_of("{}", 0);
  huge[7] = 0x7f;  // header length beyond the file
  bad(huge);
  // Every truncation of a valid file is rejected cleanly.
  safetensors::TensorMap m;
  m["x"] = Tensor::from_values({2, 2}, {1, 2, 3, 4}, DType::f32);
  auto good = safetensors::serialize(m);
  for (size_t len = 0; len < good.size(); ++len)
    bad(std::vector<uint8_t>(good.begin(), good.begin() + long(len)));
  EXPECT_THROW(safetensors::load("/nonexistent/x.safetensors"), Error);
}

// Random byte flips in the header: parse must either succeed or throw hlm::Error.
TEST(CoreSafetensors, HeaderFuzzNeverCrashes) {
  safetensors::TensorMap m;
  m["w"] = Tensor::from_values({3}, {1, 2, 3}, DType::f32);
  m["z"] = Tensor::from_values({2}, {4, 5}, DType::i64);
  const auto good = safetensors::serialize(m);
  Rng rng(testing::test_seed());
  for (int trial = 0; trial < 3000; ++trial) {
    auto b = good;
    const int flips = 1 + int(rng.below(3));
    for (int f = 0; f < flips; ++f) b[8 + rng.below(good.size() - 8)] = uint8_t(rng.below(256));
    try {
      safetensors::parse(b, "fuzz");
    } catch (const Error&) {
    }
  }
}

// ---- the format's invariants (docs/robustness.md, item 5) ---------------------------------------

std::string parse_error(const std::vector<uint8_t>& b) {
  try {
    safetensors::parse(b, "f");
  } catch (const Error& e) {
    return e.what();
  }
  return "(parsed)";
}

TEST(CoreSafetensors, AHeaderLengthOneByteShortIsRefusedNotShifted) {
  // The reference layout pads the header with spaces; one byte less still parses as JSON, and
  // every value was read one byte early.
  const std::string h = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})"
                        "    ";
  auto b = file_of(h, 8);
  const float a[2] = {1.5f, -2.0f};
  std::memcpy(b.data() + 8 + h.size(), a, 8);
  EXPECT_EQ(safetensors::parse(b, "f").tensors.at("a").to_f64_vector(),
            (std::vector<double>{1.5, -2.0}));
  b[0] = uint8_t(h.size() - 1);
  const std::string e = parse_error(b);
  EXPECT_NE(e.find("trailing bytes"), std::string::npos) << e;
}

TEST(CoreSafetensors, TheTensorsMustCoverTheDataBufferExactly) {
  // Trailing bytes after the last tensor.
  std::string e =
      parse_error(file_of(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", 3));
  EXPECT_NE(e.find("1 trailing bytes"), std::string::npos) << e;
  // A gap before a tensor.
  e = parse_error(file_of(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})", 3));
  EXPECT_NE(e.find("no tensor covers"), std::string::npos) << e;
  e = parse_error(file_of(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                          R"("b":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}})",
                          3));
  EXPECT_NE(e.find("no tensor covers"), std::string::npos) << e;
  // Exact cover in any header order, empty tensors included.
  const auto ok = file_of(R"({"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},)"
                          R"("z":{"dtype":"F32","shape":[0],"data_offsets":[2,2]},)"
                          R"("a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})",
                          2);
  EXPECT_EQ(safetensors::parse(ok, "f").tensors.size(), 3u);
  // The header must start with '{'.
  e = parse_error(file_of(R"( {"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1));
  EXPECT_NE(e.find("starting with '{'"), std::string::npos) << e;
}

TEST(CoreSafetensors, DuplicateNamesAreRefusedNotLastWins) {
  std::string e = parse_error(file_of(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                                      R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                                      2));
  EXPECT_NE(e.find("gives the key 'a' twice"), std::string::npos) << e;
  e = parse_error(file_of(R"({"__metadata__":{"k":"1","k":"2"}})", 0));
  EXPECT_NE(e.find("'k' twice"), std::string::npos) << e;
  e = parse_error(
      file_of(R"({"a":{"dtype":"U8","dtype":"F32","shape":[1],"data_offsets":[0,1]}})", 1));
  EXPECT_NE(e.find("'dtype' twice"), std::string::npos) << e;
}

TEST(CoreSafetensors, EveryWrittenFileCarriesAChecksumThatCatchesBitFlips) {
  Rng rng(testing::test_seed());
  safetensors::TensorMap m;
  m["w"] = randn({4, 8}, DType::f32, rng);
  m["ids"] = Tensor::from_values({3}, {1, 2, 3}, DType::i64);
  const auto good = safetensors::serialize(m, {{"step", "7"}});
  const auto c = safetensors::parse(good, "f");
  ASSERT_EQ(c.metadata.count(safetensors::kChecksumKey), 1u);
  EXPECT_EQ(c.metadata.at("step"), "7");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | good[size_t(i)];
  // Every single bit flip in the data buffer is caught.
  for (size_t i = 8 + n; i < good.size(); ++i)
    for (int bit = 0; bit < 8; bit += 3) {
      auto b = good;
      b[i] ^= uint8_t(1 << bit);
      const std::string e = parse_error(b);
      ASSERT_NE(e.find("checksum mismatch"), std::string::npos) << "byte " << i << ": " << e;
    }
  // A header value changed consistently (metadata edited, a shape swapped) is caught too.
  std::string h(reinterpret_cast<const char*>(good.data()) + 8, size_t(n));
  const size_t at = h.find("\"7\"");
  ASSERT_NE(at, std::string::npos);
  auto b = good;
  b[8 + at + 1] = '8';
  EXPECT_NE(parse_error(b).find("checksum mismatch"), std::string::npos);
  // Files without the entry (other writers) are read as they are; a re-save recomputes it.
  const auto plain = file_of(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1);
  EXPECT_EQ(safetensors::parse(plain, "f").metadata.count(safetensors::kChecksumKey), 0u);
  const auto again = safetensors::serialize(c.tensors, c.metadata);
  EXPECT_NO_THROW(safetensors::parse(again, "f"));
}

TEST(CoreSafetensors, ReadHeaderGivesShapesWithoutTheData) {
  safetensors::TensorMap m;
  m["a"] = Tensor::zeros({3, 4}, DType::bf16);
  m["b"] = Tensor::zeros({5}, DType::i32);
  const std::string path = ::testing::TempDir() + "/hdr_" + std::to_string(::getpid());
  safetensors::save(path, m);
  const safetensors::Header h = safetensors::read_header(path);
  ASSERT_EQ(h.tensors.size(), 2u);
  EXPECT_EQ(h.tensors.at("a").shape, (Shape{3, 4}));
  EXPECT_EQ(h.tensors.at("a").dtype, DType::bf16);
  EXPECT_EQ(h.tensors.at("b").end - h.tensors.at("b").begin, 20u);
  EXPECT_EQ(h.data_size, 44u);
  std::remove(path.c_str());
}

TEST(CoreSafetensors, StreamHandsOverOnlyTheWantedTensorsInDataOrder) {
  Rng rng(testing::test_seed());
  safetensors::TensorMap m;
  m["a"] = randn({3, 4}, DType::bf16, rng);
  m["big"] = randn({300, 1000}, DType::f32, rng);  // 1.2 MB: skipped in two 1 MiB chunks
  m["c"] = Tensor::from_values({3}, {1, 2, 3}, DType::i64);
  m["d"] = randn({7}, DType::f64, rng);
  const std::string path = ::testing::TempDir() + "/stream_" + std::to_string(::getpid());
  safetensors::save(path, m, {{"step", "3"}});
  std::vector<std::string> asked, taken;
  safetensors::Metadata meta;
  safetensors::stream(
      path,
      [&](const std::string& name, const safetensors::TensorInfo&) {
        asked.push_back(name);
        return name != "big";
      },
      [&](const std::string& name, Tensor t) {
        taken.push_back(name);
        EXPECT_TRUE(testing::bit_equal(t, m.at(name))) << name;
      },
      [&](const safetensors::Header& h) { meta = h.metadata; });
  EXPECT_EQ(asked, (std::vector<std::string>{"a", "big", "c", "d"}));  // the writer's data order
  EXPECT_EQ(taken, (std::vector<std::string>{"a", "c", "d"}));
  EXPECT_EQ(meta.at("step"), "3");

  // A bit flipped in a tensor nobody reads is still caught by the checksum, and one in the header
  // before anything is handed over.
  std::vector<uint8_t> bytes;
  {
    std::ifstream f(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(f), {});
  }
  const safetensors::Header h = safetensors::read_header(path);
  auto damaged = bytes;
  damaged[size_t(h.data_begin + h.tensors.at("big").begin + 123457)] ^= 0x10;
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(damaged.data()), std::streamsize(damaged.size()));
  testing::expect_error(
      [&] {
        safetensors::stream(
            path, [](const std::string& n, const safetensors::TensorInfo&) { return n != "big"; },
            [](const std::string&, Tensor) {});
      },
      "checksum mismatch");
  // A file cut short: the read names the file and where it ends.
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size() - 10));
  testing::expect_error(
      [&] {
        safetensors::stream(
            path, [](const std::string&, const safetensors::TensorInfo&) { return true; },
            [](const std::string&, Tensor) {});
      },
      "tensor 'd': data_offsets [1200048, 1200104) outside the data buffer of 1200094 bytes");
  std::remove(path.c_str());
}

}  // namespace
}  // namespace hlm
