// metadata.json: a round trip is exact, and malformed or hostile metadata is refused with the
// field named, before anything is allocated or read.
#include <gtest/gtest.h>

#include <functional>

#include "acc/checkpoint/format.hpp"
#include "acc/util/error.hpp"
#include "error_of.hpp"

namespace acc::ckpt {
namespace {

Metadata sample() {
  Metadata m;
  m.step = 42;
  m.world = 2;
  m.model_trace_hash = "0123456789abcdef";
  m.strategy = nlohmann::json::parse(R"([{"name": "zero2"}])");
  m.extra = {{"optimizer_steps", {{"w", 3}}}};
  m.files = {shard_file_name(0), shard_file_name(1)};
  TensorInfo w;
  w.name = "w";
  w.kind = "parameter";
  w.param = "w";
  w.shape = {4, 3};
  w.chunks = {{0, 0, 6, 0, 20, 0x0123456789abcdefULL}, {1, 6, 6, 0, 21, 0xfedcba9876543210ULL}};
  TensorInfo s = w;
  s.name = "state.w.exp_avg";
  s.kind = "optimizer_state";
  s.field = "exp_avg";
  s.chunks = {{0, 0, 12, 20, 30, 7}};
  m.tensors = {w, s};
  return m;
}

TEST(Metadata, RoundTripIsExact) {
  const Metadata m = sample();
  const Metadata back = parse_metadata(m.to_json().dump(), "test");
  EXPECT_EQ(back.to_json(), m.to_json());
  ASSERT_NE(back.find("state.w.exp_avg"), nullptr);
  EXPECT_EQ(back.find("w")->chunks[1].xxh64, 0xfedcba9876543210ULL);
  EXPECT_EQ(back.find("nope"), nullptr);
  EXPECT_EQ(shard_file_name(7), "shard-00007.bin");
}

TEST(Metadata, MalformedOrHostileIsRefusedNamingTheField) {
  const nlohmann::json good = sample().to_json();
  struct Case {
    std::string name;
    std::function<void(nlohmann::json&)> edit;
    std::string words;
  };
  const std::vector<Case> cases = {
      {"newer version", [](nlohmann::json& j) { j["version"] = 2; },
       "field 'version' is 2, newer than this build reads (1)"},
      {"other format", [](nlohmann::json& j) { j["format"] = "dcp"; }, "field 'format' must be"},
      {"path traversal", [](nlohmann::json& j) { j["files"][0] = "../../etc/passwd"; },
       "field 'files[0]' must be a shard file name"},
      {"absolute path", [](nlohmann::json& j) { j["files"][1] = "/tmp/shard-00001.bin"; },
       "field 'files[1]' must be a shard file name"},
      {"file twice", [](nlohmann::json& j) { j["files"][1] = j["files"][0]; },
       "field 'files[1]' is listed twice"},
      {"file index", [](nlohmann::json& j) { j["tensors"][0]["chunks"][0]["file"] = 2; },
       "field 'tensors[0].chunks[0].file' must be"},
      {"duplicated name", [](nlohmann::json& j) { j["tensors"][1]["name"] = "w"; },
       "field 'tensors[1].name' repeats the tensor name 'w'"},
      {"overflowing shape",
       [](nlohmann::json& j) {
         j["tensors"][0]["shape"] = {int64_t{1} << 40, int64_t{1} << 40};
       },
       "more than 64 bits count"},
      {"negative size",
       [](nlohmann::json& j) {
         j["tensors"][0]["shape"] = {-1, 3};
       },
       "must hold sizes >= 0"},
      {"bytes overflow", [](nlohmann::json& j) { j["tensors"][0]["shape"] = {int64_t{1} << 62}; },
       "too large in bytes"},
      {"unknown dtype", [](nlohmann::json& j) { j["tensors"][0]["dtype"] = "f128"; },
       "field 'tensors[0].dtype' is not a known dtype"},
      {"range past the tensor",
       [](nlohmann::json& j) { j["tensors"][0]["chunks"][1]["length"] = 7; },
       "field 'tensors[0].chunks[1].length' must be"},
      {"gap",
       [](nlohmann::json& j) {
         j["tensors"][0]["chunks"][1]["offset"] = 7;
         j["tensors"][0]["chunks"][1]["length"] = 5;
       },
       "chunks must tile the tensor"},
      {"not covered", [](nlohmann::json& j) { j["tensors"][0]["chunks"].erase(1); },
       "field 'tensors[0].chunks' cover elements [0, 6) of 12"},
      {"byte range overflow",
       [](nlohmann::json& j) { j["tensors"][0]["chunks"][0]["byte_offset"] = INT64_MAX - 4; },
       "field 'tensors[0].chunks[0].byte_length' must be"},
      {"checksum text", [](nlohmann::json& j) { j["tensors"][0]["chunks"][0]["xxh64"] = "xyz"; },
       "field 'tensors[0].chunks[0].xxh64' must be 16 lower-case hex digits"},
      {"unknown field", [](nlohmann::json& j) { j["tensors"][0]["owner"] = 1; },
       "field 'tensors[0].owner' is not known"},
      {"missing tensors", [](nlohmann::json& j) { j.erase("tensors"); },
       "field 'tensors' is missing"},
  };
  for (const Case& c : cases) {
    nlohmann::json j = good;
    c.edit(j);
    const std::string msg = test::error_of<ValueError>([&] { parse_metadata(j.dump(), "m.json"); });
    EXPECT_NE(msg.find("checkpoint metadata 'm.json'"), std::string::npos) << c.name << ": " << msg;
    EXPECT_NE(msg.find(c.words), std::string::npos) << c.name << ": " << msg;
  }
  // Not JSON at all, and a repeated key (which nlohmann would silently resolve).
  EXPECT_THROW(parse_metadata("{\"format\": ", "m.json"), ValueError);
  EXPECT_THROW(parse_metadata(R"({"format": "a", "format": "b"})", "m.json"), ValueError);
}

}  // namespace
}  // namespace acc::ckpt
