#include "acc/io/safetensors.hpp"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>

#include "acc/tensor/tensor.hpp"
#include "acc/util/error.hpp"
#include "acc/util/file.hpp"

namespace acc::io {
namespace {

namespace fs = std::filesystem;

std::string u64_le(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// A file with this exact header text (no padding added) and data section.
std::string make_file(const std::string& header, const std::string& data) {
  return u64_le(header.size()) + header + data;
}

template <class T>
std::string bytes_of(std::initializer_list<T> values) {
  std::string s(values.size() * sizeof(T), '\0');
  std::memcpy(s.data(), std::data(values), s.size());
  return s;
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("acc_io_test_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  std::string write(const std::string& name, const std::string& bytes) const {
    std::ofstream out(dir_ / name, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return path(name);
  }

  // Loads `bytes` from a file and expects an acc::IoError whose message names the file and
  // contains `substring`.
  void expect_load_error(const std::string& bytes, const std::string& substring) const {
    const std::string p = write("bad.safetensors", bytes);
    try {
      load_safetensors(p);
      ADD_FAILURE() << "expected an IoError containing '" << substring << "'";
    } catch (const IoError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(substring), std::string::npos) << msg;
      EXPECT_NE(msg.find(p), std::string::npos) << "message does not name the file: " << msg;
    }
    // The header-only reader validates the same way.
    EXPECT_THROW(read_safetensors_header(p), IoError);
  }

  fs::path dir_;
};

// The raw bytes of a tensor in logical order (to_vector goes through double, which rounds
// int64 values above 2^53).
std::string raw_bytes(const Tensor& t) {
  Tensor c = t.contiguous();
  if (c.nbytes() == 0) return {};
  return std::string(static_cast<const char*>(c.raw_data()), c.nbytes());
}

std::vector<int64_t> i64_values(const Tensor& t) {
  Tensor c = t.contiguous();
  return std::vector<int64_t>(c.data<int64_t>(), c.data<int64_t>() + c.numel());
}

void expect_same(const Tensor& got, const Tensor& want) {
  EXPECT_EQ(got.dtype(), want.dtype());
  EXPECT_EQ(got.shape(), want.shape());
  if (got.numel() > 0) {
    EXPECT_TRUE(got.is_contiguous());
  }
  EXPECT_EQ(raw_bytes(got), raw_bytes(want));
}

// ---------------------------------------------------------------------------------------------
// round trips and the exact format

TEST_F(Safetensors, RoundTripsEveryDtypeStridesScalarAndEmpty) {
  Tensor base =
      from_vector({0.f, 1.5f, -2.f, 3.25f, 4.f, -5.5f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f}, {3, 4});
  NamedTensors tensors = {
      {"f32", base},
      {"bf16", from_vector({1.f, -0.5f, 3.f}, {3}, {DType::kBFloat16})},
      {"i32", from_vector(std::vector<int32_t>{-7, 0, 2147483647, -2147483647 - 1}, {2, 2})},
      {"i64", from_vector(std::vector<int64_t>{(int64_t{1} << 62) + 1, -3}, {2})},
      {"transposed", base.transpose(0, 1)},
      {"strided", base.slice(1, 0, 4, 2).slice(0, 1, 3)},
      {"bf16.transposed", base.to(DType::kBFloat16).transpose(0, 1)},
      {"scalar", scalar_tensor(2.5)},
      {"empty", zeros({0, 3})},
      {"empty.i64", empty({4, 0}, {DType::kInt64})},
  };
  ASSERT_FALSE(tensors[4].second.is_contiguous());
  ASSERT_FALSE(tensors[5].second.is_contiguous());
  const Metadata meta = {{"format", "pt"}, {"step", "42"}, {"utf8", "h\xc3\xa9llo"}};
  const std::string p = path("model.safetensors");
  save_safetensors(p, tensors, meta);

  SafetensorsFile f = load_safetensors(p);
  EXPECT_EQ(f.path, p);
  EXPECT_EQ(f.metadata, meta);
  ASSERT_EQ(f.tensors.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    SCOPED_TRACE(tensors[i].first);
    EXPECT_EQ(f.tensors[i].first, tensors[i].first);  // insertion order is kept
    expect_same(f.tensors[i].second, tensors[i].second);
  }
  EXPECT_EQ(f.at("strided").to_vector<float>(), (std::vector<float>{4.f, 6.f, 8.f, 10.f}));
  EXPECT_EQ(i64_values(f.at("i64")), (std::vector<int64_t>{(int64_t{1} << 62) + 1, -3}));
  EXPECT_EQ(f.at("scalar").dim(), 0);
  EXPECT_EQ(f.at("scalar").item(), 2.5);
  EXPECT_TRUE(f.contains("empty"));
  EXPECT_FALSE(f.contains("nope"));
  EXPECT_EQ(list_safetensors(p), f.names());

  // The in-memory forms agree with the file.
  const std::string bytes = serialize_safetensors(tensors, meta);
  EXPECT_EQ(bytes, read_bytes(p));
  SafetensorsFile m = deserialize_safetensors(bytes, "mem");
  EXPECT_EQ(m.names(), f.names());
  expect_same(m.at("transposed"), f.at("transposed"));
}

TEST_F(Safetensors, LoadedTensorsOwnTheirMemory) {
  const std::string p = path("a.safetensors");
  save_safetensors(p, {{"a", from_vector({1.f, 2.f}, {2})}});
  Tensor a;
  {
    SafetensorsFile f = load_safetensors(p);
    a = f.at("a");
  }
  fs::remove(p);
  EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{1.f, 2.f}));
}

TEST_F(Safetensors, WritesTheSpecByteForByte) {
  // Built by hand from the spec: u64 LE header length, compact JSON with __metadata__ first and
  // fields in the order dtype, shape, data_offsets, space padding to a multiple of 8, then the
  // data in the caller's order, little-endian.
  const std::string json = R"({"__metadata__":{"a":"1","b":"x"},)"
                           R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("idx":{"dtype":"I64","shape":[],"data_offsets":[8,16]},)"
                           R"("hh":{"dtype":"BF16","shape":[1,1],"data_offsets":[16,18]}})";
  std::string header = json;
  while (header.size() % 8 != 0) header += ' ';
  ASSERT_NE(json.size(), header.size()) << "pick names so that padding is exercised";
  const std::string data = std::string("\x00\x00\x80\x3f", 4) +                  // 1.0f
                           std::string("\x00\x00\x00\xc0", 4) +                  // -2.0f
                           std::string("\x05\x00\x00\x00\x00\x00\x00\x80", 8) +  // INT64_MIN + 5
                           std::string("\xc0\x3f", 2);                           // bf16 1.5
  const std::string expected = u64_le(header.size()) + header + data;

  NamedTensors tensors = {
      {"w", from_vector({1.f, -2.f}, {2})},
      {"idx", from_vector(std::vector<int64_t>{std::numeric_limits<int64_t>::min() + 5}, {})},
      {"hh", full({1, 1}, 1.5, {DType::kBFloat16})},
  };
  const Metadata meta = {{"b", "x"}, {"a", "1"}};
  EXPECT_EQ(serialize_safetensors(tensors, meta), expected);
  const std::string p = path("exact.safetensors");
  save_safetensors(p, tensors, meta);
  EXPECT_EQ(read_bytes(p), expected);

  // Reading hand-made bytes gives the values back.
  SafetensorsFile f = deserialize_safetensors(expected);
  EXPECT_EQ(f.at("w").to_vector<float>(), (std::vector<float>{1.f, -2.f}));
  EXPECT_EQ(f.at("idx").shape(), Shape{});
  EXPECT_EQ(i64_values(f.at("idx"))[0], std::numeric_limits<int64_t>::min() + 5);
  EXPECT_EQ(f.at("hh").to_vector<float>(), (std::vector<float>{1.5f}));
}

TEST_F(Safetensors, OmitsEmptyMetadataAndPadsEveryHeaderToEightBytes) {
  const std::string no_meta = serialize_safetensors({{"x", zeros({1})}});
  const std::string json = R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  std::string header = json;
  while (header.size() % 8 != 0) header += ' ';
  EXPECT_EQ(no_meta, u64_le(header.size()) + header + std::string(4, '\0'));
  for (size_t len = 1; len <= 9; ++len) {
    const std::string bytes = serialize_safetensors({{std::string(len, 'n'), zeros({1})}});
    uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    EXPECT_EQ(n % 8, 0u) << "name length " << len;
    EXPECT_EQ(bytes.size(), 8 + n + 4);
  }
}

TEST_F(Safetensors, SaveReplacesAtomicallyAndLeavesNoTemporaryFiles) {
  const std::string p = path("m.safetensors");
  save_safetensors(p, {{"a", zeros({2})}});
  save_safetensors(p, {{"b", ones({3})}});
  EXPECT_EQ(list_safetensors(p), std::vector<std::string>{"b"});
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir_)) {
    ++files;
    EXPECT_EQ(entry.path().filename(), "m.safetensors");
  }
  EXPECT_EQ(files, 1);
}

TEST_F(Safetensors, SaveIntoMissingDirectoryIsIoErrorNamingThePath) {
  const std::string p = path("no/such/dir/m.safetensors");
  try {
    save_safetensors(p, {{"a", zeros({2})}});
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(p), std::string::npos) << msg;
    EXPECT_NE(msg.find("No such file or directory"), std::string::npos) << msg;
  }
}

TEST_F(Safetensors, SaveRejectsBadNamesAndTensorsAndWritesNothing) {
  const std::string p = path("bad.safetensors");
  auto expect_value_error = [&](const NamedTensors& t, const std::string& substring) {
    try {
      save_safetensors(p, t);
      ADD_FAILURE() << "expected ValueError containing '" << substring << "'";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(substring), std::string::npos) << e.what();
    }
  };
  expect_value_error({{"a", zeros({1})}, {"", zeros({1})}}, "tensor 1 has an empty name");
  expect_value_error({{"a", zeros({1})}, {"b", zeros({1})}, {"a", zeros({2})}},
                     "duplicate tensor name 'a'");
  expect_value_error({{"__metadata__", zeros({1})}}, "'__metadata__' is reserved");
  expect_value_error({{"u", Tensor()}}, "tensor 'u' is undefined");
  expect_value_error({{"bad\xff", zeros({1})}}, "tensor name is not valid utf-8");
  try {
    save_safetensors(p, {{"m", empty({4, 4}, {DType::kFloat32, Device::kMeta})}});
    ADD_FAILURE() << "expected TypeError";
  } catch (const TypeError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'm' (shape [4, 4]) is a meta tensor"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(save_safetensors(p, {{"a", zeros({1})}}, {{"k", "\xfe"}}), ValueError);
  EXPECT_FALSE(fs::exists(p));
  EXPECT_TRUE(fs::is_empty(dir_));
}

TEST_F(Safetensors, AtNamesTheMissingTensorAndTheFile) {
  const std::string p = path("m.safetensors");
  save_safetensors(p, {{"a", zeros({1})}});
  SafetensorsFile f = load_safetensors(p);
  try {
    f.at("b");
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("no tensor named 'b'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(p), std::string::npos) << msg;
  }
}

TEST_F(Safetensors, HeaderOnlyInspection) {
  const std::string p = path("m.safetensors");
  save_safetensors(p, {{"w", zeros({2, 3})}, {"h", zeros({5}, {DType::kBFloat16})}}, {{"k", "v"}});
  SafetensorsHeader h = read_safetensors_header(p);
  ASSERT_EQ(h.entries.size(), 2u);
  EXPECT_EQ(h.entries[0].name, "w");
  EXPECT_EQ(h.entries[0].dtype, "F32");
  EXPECT_EQ(h.entries[0].shape, (Shape{2, 3}));
  EXPECT_EQ(h.entries[0].begin, 0u);
  EXPECT_EQ(h.entries[0].end, 24u);
  EXPECT_EQ(h.entries[1].dtype, "BF16");
  EXPECT_EQ(h.entries[1].begin, 24u);
  EXPECT_EQ(h.entries[1].end, 34u);
  EXPECT_EQ(h.metadata, (Metadata{{"k", "v"}}));
  EXPECT_EQ(h.header_size % 8, 0u);
  EXPECT_EQ(h.data_size, 34u);
  EXPECT_EQ(8 + h.header_size + h.data_size, fs::file_size(p));
}

// ---------------------------------------------------------------------------------------------
// F16 and PyTorch interop

TEST(F16, EncodingRoundTripsEveryHalfAndRoundsToNearestEven) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const bool nan = (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0;
    if (nan) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f16_to_f32(static_cast<uint16_t>(h))))));
      continue;
    }
    ASSERT_EQ(f32_to_f16(f16_to_f32(static_cast<uint16_t>(h))), h) << std::hex << h;
  }
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // tie -> even (1.0)
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie -> even (up)
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);  // overflow -> inf
  EXPECT_EQ(f32_to_f16(-1e9f), 0xfc00);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // tie below min subnormal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.5f, -25)), 0x0001);
}

TEST(F16, SavingF32AsF16LoadsBackRounded) {
  fs::path p = fs::temp_directory_path() / ("acc_f16_" + std::to_string(::getpid()) + ".st");
  Tensor x = from_vector({0.1f, -2.5f, 70000.f, 1e-8f}, {2, 2});
  Tensor ids = from_vector(std::vector<int64_t>{1, 2}, {2});
  save_safetensors(p.string(), {{"x", x}, {"ids", ids}}, {}, {.f32_as_f16 = true});
  SafetensorsHeader h = read_safetensors_header(p.string());
  EXPECT_EQ(h.entries[0].dtype, "F16");
  EXPECT_EQ(h.entries[1].dtype, "I64");
  SafetensorsFile f = load_safetensors(p.string());
  auto v = f.at("x").to_vector<float>();
  EXPECT_EQ(v[0], f16_to_f32(0x2e66));
  EXPECT_EQ(v[1], -2.5f);
  EXPECT_TRUE(std::isinf(v[2]));
  EXPECT_EQ(v[3], 0.0f);
  EXPECT_EQ(f.at("ids").to_vector<int64_t>(), (std::vector<int64_t>{1, 2}));
  fs::remove(p);
}

TEST(F16, DecodesNormalsSubnormalsInfinitiesAndNan) {
  EXPECT_EQ(f16_to_f32(0x0000), 0.0f);
  EXPECT_TRUE(std::signbit(f16_to_f32(0x8000)));
  EXPECT_EQ(f16_to_f32(0x8000), 0.0f);
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0xc000), -2.0f);
  EXPECT_EQ(f16_to_f32(0x3555), 0.333251953125f);
  EXPECT_EQ(f16_to_f32(0x2e66), 0.0999755859375f);
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);                      // largest finite
  EXPECT_EQ(f16_to_f32(0x0400), std::ldexp(1.0f, -14));         // smallest normal
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));         // smallest subnormal
  EXPECT_EQ(f16_to_f32(0x03ff), 1023 * std::ldexp(1.0f, -24));  // largest subnormal
  EXPECT_EQ(f16_to_f32(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_f32(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(f16_to_f32(0xfc00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7e00)));
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7c01)));  // signalling payload stays a NaN
  EXPECT_TRUE(std::isnan(f16_to_f32(0xfe00)));
}

TEST_F(Safetensors, LoadsF16AsF32) {
  const std::string data = bytes_of<uint16_t>({0x3c00, 0x0001, 0xfc00, 0x7e00, 0x2e66, 0x8000});
  const std::string file =
      make_file(R"({"h":{"dtype":"F16","shape":[2,3],"data_offsets":[0,12]}})", data);
  SafetensorsFile f = deserialize_safetensors(file);
  const Tensor& h = f.at("h");
  EXPECT_EQ(h.dtype(), DType::kFloat32);
  EXPECT_EQ(h.shape(), (Shape{2, 3}));
  auto v = h.to_vector<float>();
  EXPECT_EQ(v[0], 1.0f);
  EXPECT_EQ(v[1], std::ldexp(1.0f, -24));
  EXPECT_EQ(v[2], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(v[3]));
  EXPECT_EQ(v[4], 0.0999755859375f);
  EXPECT_TRUE(std::signbit(v[5]));
}

// tests/io/data/torch_written.safetensors comes from tests/io/make_torch_file.py (PyTorch 1.13),
// laid out as the reference implementation does (sorted by dtype, then name).
TEST(TorchInterop, LoadsAFileWrittenFromPyTorch) {
  const std::string p = std::string(ACC_IO_TEST_DATA_DIR) + "/torch_written.safetensors";
  SafetensorsFile f = load_safetensors(p);
  EXPECT_EQ(f.metadata.at("format"), "pt");
  EXPECT_EQ(f.metadata.at("producer").rfind("torch 1.13", 0), 0u);
  EXPECT_EQ(f.names(),
            (std::vector<std::string>{"i64", "empty", "f32.matrix", "f32.randn", "f32.transposed",
                                      "scalar", "i32", "bf16", "f16"}));

  EXPECT_EQ(f.at("f32.matrix").shape(), (Shape{2, 3}));
  EXPECT_EQ(f.at("f32.matrix").to_vector<float>(),
            (std::vector<float>{-1.f, -0.5f, 0.f, 0.5f, 1.f, 1.5f}));
  EXPECT_EQ(f.at("f32.transposed").shape(), (Shape{4, 3}));
  EXPECT_EQ(f.at("f32.transposed").to_vector<float>(),
            (std::vector<float>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
  // torch.manual_seed(0); torch.randn(2, 3)
  EXPECT_EQ(f.at("f32.randn").to_vector<float>(),
            (std::vector<float>{1.5409960746765137f, -0.293428897857666f, -2.1787893772125244f,
                                0.5684312582015991f, -1.0845223665237427f, -1.3985954523086548f}));
  EXPECT_EQ(f.at("scalar").dim(), 0);
  EXPECT_EQ(f.at("scalar").item(), 3.5);
  EXPECT_EQ(f.at("empty").shape(), (Shape{0, 3}));
  EXPECT_EQ(f.at("empty").dtype(), DType::kFloat32);

  EXPECT_EQ(f.at("i32").dtype(), DType::kInt32);
  EXPECT_EQ(f.at("i32").to_vector<int32_t>(), (std::vector<int32_t>{1, -2, 3, 2147483647}));
  EXPECT_EQ(f.at("i64").dtype(), DType::kInt64);
  EXPECT_EQ(i64_values(f.at("i64")),
            (std::vector<int64_t>{-(int64_t{1} << 40), 0, (int64_t{1} << 62) + 1}));

  // torch rounded these from float32; AutoAcc's bf16 rounding must agree bit for bit.
  const Tensor& bf = f.at("bf16");
  EXPECT_EQ(bf.dtype(), DType::kBFloat16);
  const std::vector<float> from_f32 = {1.0f, -0.1f, 3.14159265f, 65504.0f, 1e-3f};
  const BFloat16* bits = bf.data<BFloat16>();
  for (size_t i = 0; i < from_f32.size(); ++i) {
    EXPECT_EQ(bits[i].bits, BFloat16(from_f32[i]).bits) << "element " << i;
  }
  EXPECT_EQ(bf.to_vector<float>(),
            (std::vector<float>{1.0f, -0.10009765625f, 3.140625f, 65536.0f, 0.00099945068359375f}));

  const Tensor& h = f.at("f16");
  EXPECT_EQ(h.dtype(), DType::kFloat32);
  auto v = h.to_vector<float>();
  ASSERT_EQ(v.size(), 9u);
  EXPECT_EQ(v[0], 1.0f);
  EXPECT_EQ(v[1], -2.0f);
  EXPECT_EQ(v[2], 0.0999755859375f);
  EXPECT_EQ(v[3], 65504.0f);
  EXPECT_EQ(v[4], std::ldexp(1.0f, -24));
  EXPECT_EQ(v[5], std::numeric_limits<float>::infinity());
  EXPECT_EQ(v[6], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(v[7]));
  EXPECT_EQ(v[8], 0.0f);
  EXPECT_TRUE(std::signbit(v[8]));

  // Written back by AutoAcc and read again, every supported tensor survives unchanged.
  NamedTensors again;
  for (const auto& [name, t] : f.tensors) again.emplace_back(name, t);
  SafetensorsFile g = deserialize_safetensors(serialize_safetensors(again, f.metadata));
  for (const auto& [name, t] : f.tensors) {
    if (name == "f16") continue;  // NaN != NaN
    expect_same(g.at(name), t);
  }
}

// The golden files of tests/golden (written by tests/golden/safetensors_io.py, with
// "__metadata__" last) load with the names and shapes tests/golden/README.md documents.
TEST(TorchInterop, LoadsTheGoldenModelFiles) {
  const std::string golden = ACC_GOLDEN_DIR;
  SafetensorsFile gpt = load_safetensors(golden + "/gpt_tiny.safetensors");
  EXPECT_EQ(gpt.metadata.at("format"), "autoacc-golden-v1");
  EXPECT_EQ(gpt.metadata.at("model"), "gpt");
  EXPECT_EQ(gpt.names().front(), "transformer.wte.weight");
  EXPECT_EQ(gpt.at("transformer.wte.weight").shape(), (Shape{64, 32}));
  EXPECT_EQ(gpt.at("transformer.h.1.attn.c_attn.weight").shape(), (Shape{96, 32}));
  EXPECT_EQ(gpt.at("input.idx").dtype(), DType::kInt64);
  EXPECT_EQ(gpt.at("input.idx").shape(), (Shape{2, 8}));
  for (int64_t id : i64_values(gpt.at("input.idx"))) {
    EXPECT_GE(id, 0);
    EXPECT_LT(id, 64);
  }
  EXPECT_EQ(gpt.at("output.logits").shape(), (Shape{2, 8, 64}));
  EXPECT_EQ(gpt.at("output.loss").dim(), 0);
  EXPECT_NEAR(gpt.at("output.loss").item(), 4.9632, 1e-4);  // README: initial loss
  EXPECT_EQ(gpt.at("adamw.losses").shape(), (Shape{10}));

  SafetensorsFile llama = load_safetensors(golden + "/llama_tiny.safetensors");
  EXPECT_EQ(llama.at("model.embed_tokens.weight").shape(), (Shape{64, 32}));
  EXPECT_EQ(llama.at("model.layers.0.self_attn.k_proj.weight").shape(), (Shape{16, 32}));
  EXPECT_NEAR(llama.at("output.loss").item(), 4.3422, 1e-4);

  const auto names = list_safetensors(golden + "/train_ref/gpt.init.safetensors");
  EXPECT_EQ(names.front(), "transformer.wte.weight");
  EXPECT_EQ(
      read_safetensors_header(golden + "/train_ref/gpt.init.safetensors").metadata.at("model"),
      "gpt");
}

// ---------------------------------------------------------------------------------------------
// malformed files: one case each, the exception type and the problem in the message

const std::string kGoodEntry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
const std::string kEightBytes(8, '\x01');

TEST_F(Safetensors, MissingFileIsIoErrorNamingPathAndSystemError) {
  const std::string p = path("missing.safetensors");
  try {
    load_safetensors(p);
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(p), std::string::npos) << msg;
    EXPECT_NE(msg.find("No such file or directory"), std::string::npos) << msg;
  }
  EXPECT_THROW(list_safetensors(p), IoError);
}

TEST_F(Safetensors, FileShorterThanEightBytes) {
  expect_load_error("", "file has 0 bytes, too short");
  expect_load_error(std::string(7, '\0'), "file has 7 bytes, too short");
}

TEST_F(Safetensors, HeaderLengthBeyondTheFile) {
  expect_load_error(u64_le(100) + "{}", "header length 100 is larger than the 2 bytes");
}

TEST_F(Safetensors, AbsurdHeaderLength) {
  expect_load_error(u64_le(100'000'001) + "{}", "header length 100000001 exceeds the limit");
  expect_load_error(u64_le(~uint64_t{0}) + "{}", "exceeds the limit");
}

TEST_F(Safetensors, HeaderNotValidJson) {
  expect_load_error(make_file(R"({"a":{"dtype":)", ""), "header is not valid JSON");
  expect_load_error(make_file("\x89PNG\r\n\x1a\n", ""), "header is not valid JSON");
}

TEST_F(Safetensors, HeaderNotAnObject) {
  expect_load_error(make_file("[1,2,3] ", ""), "header is not a JSON object but array");
}

TEST_F(Safetensors, EntryNotAnObject) {
  expect_load_error(make_file(R"({"a":[1]})", ""), "tensor 'a': entry is not a JSON object");
}

TEST_F(Safetensors, EntryMissingDtype) {
  expect_load_error(make_file(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", kEightBytes),
                    "tensor 'a': entry has no 'dtype'");
}

TEST_F(Safetensors, EntryMissingShape) {
  expect_load_error(make_file(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", kEightBytes),
                    "tensor 'a': entry has no 'shape'");
}

TEST_F(Safetensors, EntryMissingDataOffsets) {
  expect_load_error(make_file(R"({"a":{"dtype":"F32","shape":[2]}})", kEightBytes),
                    "tensor 'a': entry has no 'data_offsets'");
}

TEST_F(Safetensors, UnknownDtypeIsNamed) {
  expect_load_error(
      make_file(R"({"a":{"dtype":"Q4_K","shape":[2],"data_offsets":[0,8]}})", kEightBytes),
      "tensor 'a': unknown dtype 'Q4_K'");
}

TEST_F(Safetensors, UnsupportedDtypeIsNamed) {
  expect_load_error(
      make_file(R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", kEightBytes),
      "tensor 'a': unsupported dtype 'F64'");
}

TEST_F(Safetensors, NegativeDimension) {
  expect_load_error(
      make_file(R"({"a":{"dtype":"F32","shape":[2,-2],"data_offsets":[0,8]}})", kEightBytes),
      "tensor 'a': negative dimension -2 in shape [2,-2]");
}

TEST_F(Safetensors, NonIntegerShapeAndOffsets) {
  expect_load_error(
      make_file(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", kEightBytes),
      "must hold integers");
  expect_load_error(
      make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", kEightBytes),
      "data_offsets must be an array [begin, end]");
  expect_load_error(
      make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", kEightBytes),
      "data_offsets must be non-negative integers");
}

TEST_F(Safetensors, DataOffsetsBeyondTheFile) {
  // The header promises 8 bytes; the file was cut after 4.
  expect_load_error(make_file("{" + kGoodEntry + "}", std::string(4, '\0')),
                    "tensor 'a': data_offsets [0, 8] exceed the data section of 4 bytes");
}

TEST_F(Safetensors, BeginAfterEnd) {
  expect_load_error(
      make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", kEightBytes),
      "tensor 'a': data_offsets [8, 0] have begin > end");
}

TEST_F(Safetensors, ByteSizeNotMatchingShapeAndDtype) {
  expect_load_error(
      make_file(R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})",
                std::string(20, '\0')),
      "tensor 'a' (dtype F32, shape [2, 3]) needs 24 bytes but data_offsets [0, 20] cover 20");
}

TEST_F(Safetensors, OverflowingShape) {
  expect_load_error(
      make_file(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})",
                kEightBytes),
      "is too large");
}

TEST_F(Safetensors, OverlappingTensors) {
  expect_load_error(make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                              R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                              std::string(12, '\0')),
                    "tensors 'a' [0, 8] and 'b' [4, 12] overlap");
  // Two names for the same bytes are an overlap too.
  expect_load_error(make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                              R"("b":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}})",
                              kEightBytes),
                    "overlap in the data section");
}

TEST_F(Safetensors, GapInTheDataSection) {
  expect_load_error(make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                              R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                              std::string(12, '\0')),
                    "bytes [4, 8) of the data section before tensor 'b' belong to no tensor");
}

TEST_F(Safetensors, TrailingBytesAfterTheLastTensor) {
  expect_load_error(make_file("{" + kGoodEntry + "}", std::string(12, '\0')),
                    "the data section has 12 bytes but the tensors cover only 8");
}

TEST_F(Safetensors, DuplicateNames) {
  expect_load_error(make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                              R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                              kEightBytes),
                    "duplicate tensor name 'a'");
}

// Found with fuzz_safetensors' round-trip check (on a hand-made input): a file with an empty tensor
// name loaded, but save_safetensors refuses that name, so the loaded tensors could not be saved
// again.
TEST_F(Safetensors, EmptyTensorName) {
  expect_load_error(
      make_file(R"({"":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", kEightBytes),
      "a tensor has an empty name");
}

TEST_F(Safetensors, RepeatedKeysInsideAnEntryOrTheMetadata) {
  // nlohmann kept the last "dtype" (I32) and loaded the tensor as such.
  expect_load_error(
      make_file(R"({"a":{"dtype":"F32","dtype":"I32","shape":[2],"data_offsets":[0,8]}})",
                kEightBytes),
      "duplicate key 'dtype' in the header entry 'a'");
  expect_load_error(
      make_file(R"({"__metadata__":{"k":"1","k":"2"},)" + kGoodEntry + "}", kEightBytes),
      "duplicate key 'k' in the header entry '__metadata__'");
}

// Found while writing fuzz_safetensors (a hand-made input, deeper than libFuzzer's inputs go): a
// shape (or dtype, or any value printed in an error message) nested 200,000 deep overflowed the
// stack in nlohmann's recursive dump().
TEST_F(Safetensors, DeepNestingIsRefusedNotAStackOverflow) {
  const std::string deep = std::string(200'000, '[') + std::string(200'000, ']');
  expect_load_error(
      make_file(R"({"a":{"dtype":"F32","shape":)" + deep + R"(,"data_offsets":[0,0]}})", ""),
      "header nests deeper than 128 levels");
  expect_load_error(
      make_file(R"({"a":{"dtype":)" + deep + R"(,"shape":[],"data_offsets":[0,0]}})", ""),
      "header nests deeper than 128 levels");
  // Shallow enough nesting still reaches the usual checks.
  expect_load_error(
      make_file(R"({"a":{"dtype":"F32","shape":[[[2]]],"data_offsets":[0,8]}})", kEightBytes),
      "shape [[[2]]] must hold integers");
}

TEST_F(Safetensors, MetadataMustMapStringsToStrings) {
  expect_load_error(make_file(R"({"__metadata__":{"step":3},)" + kGoodEntry + "}", kEightBytes),
                    "__metadata__ value of 'step' must be a string");
  expect_load_error(make_file(R"({"__metadata__":[],)" + kGoodEntry + "}", kEightBytes),
                    "__metadata__ must be an object");
}

TEST_F(Safetensors, AcceptsOutOfOrderEntriesZeroSizeTensorsAndEmptyFiles) {
  // Header order differs from data order; zero-byte tensors sit at boundaries.
  const std::string file =
      make_file(R"({"b":{"dtype":"I32","shape":[1],"data_offsets":[4,8]},)"
                R"("z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
                R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                R"("e":{"dtype":"BF16","shape":[3,0],"data_offsets":[8,8]}}   )",
                bytes_of<float>({2.5f}) + bytes_of<int32_t>({-9}));
  const std::string p = write("ok.safetensors", file);
  SafetensorsFile f = load_safetensors(p);
  EXPECT_EQ(f.names(), (std::vector<std::string>{"b", "z", "a", "e"}));
  EXPECT_EQ(f.at("a").item(), 2.5);
  EXPECT_EQ(f.at("b").item(), -9);
  EXPECT_EQ(f.at("e").shape(), (Shape{3, 0}));
  // A file with no tensors at all is valid.
  EXPECT_TRUE(deserialize_safetensors(make_file("{}      ", "")).tensors.empty());
  EXPECT_TRUE(deserialize_safetensors(serialize_safetensors({})).tensors.empty());
}

}  // namespace
}  // namespace acc::io

namespace acc {
namespace {

// A save killed with SIGKILL leaves "<path>.tmp.<host>.<pid>.<n>" behind (issue 16 item 5): the
// next save of the path removes it, and only it (a live process's or another host's stays).
TEST(SafetensorsSave, NextSaveRemovesTheTempFileOfAKilledSave) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("acc_stale_tmp_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "w.safetensors").string();
  // A pid that has just exited stands for the killed saver.
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ::waitpid(child, nullptr, 0);
  const std::string mine = temp_file_for(path);  // "<path>.tmp.<host>.<my pid>.<n>"
  const std::string host_prefix = mine.substr(0, mine.rfind('.', mine.rfind('.') - 1) + 1);
  const std::string stale = host_prefix + std::to_string(child) + ".0";
  const std::string live = host_prefix + std::to_string(::getpid()) + ".7";
  const std::string other_host = path + ".tmp.some-other-host." + std::to_string(child) + ".0";
  for (const auto& f : {stale, live, other_host}) std::ofstream(f) << "partial";
  io::save_safetensors(path, {{"x", ones({2})}});
  EXPECT_FALSE(fs::exists(stale)) << stale;
  EXPECT_TRUE(fs::exists(live)) << live;
  EXPECT_TRUE(fs::exists(other_host)) << other_host;
  EXPECT_EQ(io::load_safetensors(path).tensors.size(), 1u);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace acc
