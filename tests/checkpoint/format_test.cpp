// metadata.json: a round trip is exact, version 1 still reads, and malformed or hostile metadata
// (hostile boxes among it) is refused with the field named, before anything is allocated or read.
#include <gtest/gtest.h>

#include <functional>

#include "acc/checkpoint/format.hpp"
#include "acc/util/error.hpp"
#include "error_of.hpp"

namespace acc::ckpt {
namespace {

using dist::Box;
using dist::FlatRange;

ChunkInfo chunk(int file, Box box, std::optional<FlatRange> flat, int64_t byte_offset,
                uint64_t xxh64 = 7) {
  ChunkInfo c;
  c.file = file;
  c.box = std::move(box);
  c.flat = flat;
  c.byte_offset = byte_offset;
  c.byte_length = 20;
  c.xxh64 = xxh64;
  return c;
}

// Version 2: 'w' [4, 3] in row blocks, the second block split flat in two (ZeRO over a box);
// its exp_avg in column blocks (a tensor-parallel split).
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
  w.kind = dist::TensorKind::kParameter;
  w.param = "w";
  w.shape = {4, 3};
  w.chunks = {chunk(0, {{0, 0}, {2, 3}}, std::nullopt, 0, 0x0123456789abcdefULL),
              chunk(1, {{2, 0}, {2, 3}}, FlatRange{0, 3}, 0, 0xfedcba9876543210ULL),
              chunk(1, {{2, 0}, {2, 3}}, FlatRange{3, 3}, 20)};
  TensorInfo s = w;
  s.name = "state.w.exp_avg";
  s.kind = dist::TensorKind::kOptimizerState;
  s.field = "exp_avg";
  s.chunks = {chunk(0, {{0, 0}, {4, 1}}, std::nullopt, 20),
              chunk(1, {{0, 1}, {4, 2}}, std::nullopt, 40)};
  m.tensors = {w, s};
  return m;
}

// Version 1, as the previous release wrote it: flat ranges of the whole tensor.
nlohmann::json sample_v1() {
  return nlohmann::json::parse(R"({
    "format": "autoacc-checkpoint", "version": 1, "step": 42, "world": 2,
    "model_trace_hash": "0123456789abcdef", "strategy": [{"name": "zero2"}], "extra": {},
    "files": ["shard-00000.bin", "shard-00001.bin"],
    "tensors": [
      {"name": "w", "kind": "parameter", "param": "w", "field": "", "shape": [4, 3],
       "dtype": "f32",
       "chunks": [{"file": 0, "offset": 0, "length": 6, "byte_offset": 0, "byte_length": 20,
                   "xxh64": "0123456789abcdef"},
                  {"file": 1, "offset": 6, "length": 6, "byte_offset": 0, "byte_length": 21,
                   "xxh64": "fedcba9876543210"}]},
      {"name": "state.w.exp_avg", "kind": "optimizer_state", "param": "w", "field": "exp_avg",
       "shape": [4, 3], "dtype": "f32",
       "chunks": [{"file": 0, "offset": 0, "length": 12, "byte_offset": 20, "byte_length": 30,
                   "xxh64": "0000000000000007"}]}]})");
}

TEST(Metadata, RoundTripIsExact) {
  const Metadata m = sample();
  const Metadata back = parse_metadata(m.to_json().dump(), "test");
  EXPECT_EQ(back.to_json(), m.to_json());
  EXPECT_EQ(back.version, 2);
  ASSERT_NE(back.find("state.w.exp_avg"), nullptr);
  EXPECT_EQ(back.find("state.w.exp_avg")->kind, dist::TensorKind::kOptimizerState);
  EXPECT_EQ(back.find("w")->chunks[1].xxh64, 0xfedcba9876543210ULL);
  EXPECT_EQ(back.find("w")->chunks[2].flat, (FlatRange{3, 3}));
  EXPECT_EQ(back.find("w")->chunks[2].region(), "box [2:4, 0:3] flat [3, 6)");
  EXPECT_EQ(back.find("nope"), nullptr);
  EXPECT_EQ(shard_file_name(7), "shard-00007.bin");
  // The words of the JSON are as before: kind is "parameter" or "optimizer_state".
  EXPECT_EQ(m.to_json()["tensors"][1]["kind"], "optimizer_state");
}

TEST(Metadata, Version1ReadsAsFlatRangesOfTheWholeTensor) {
  const Metadata m = parse_metadata(sample_v1().dump(), "v1");
  EXPECT_EQ(m.version, 1);
  const TensorInfo& w = *m.find("w");
  ASSERT_EQ(w.chunks.size(), 2u);
  EXPECT_EQ(w.chunks[1].box, (Box{{0, 0}, {4, 3}}));
  EXPECT_EQ(w.chunks[1].flat, (FlatRange{6, 6}));
  EXPECT_EQ(w.chunks[1].file, 1);
  EXPECT_EQ(w.chunks[1].xxh64, 0xfedcba9876543210ULL);
  // One chunk of the whole tensor: its box, no flat range.
  EXPECT_EQ(m.find("state.w.exp_avg")->chunks[0].flat, std::nullopt);
  EXPECT_FALSE(tiling_error(w).has_value());
  // Written back, it is version 2 and reads the same.
  const nlohmann::json j = m.to_json();
  EXPECT_EQ(j["version"], 2);
  EXPECT_EQ(parse_metadata(j.dump(), "v2").to_json(), j);
}

struct Case {
  std::string name;
  std::function<void(nlohmann::json&)> edit;
  std::string words;
};

void expect_refused(const nlohmann::json& good, const std::vector<Case>& cases) {
  for (const Case& c : cases) {
    nlohmann::json j = good;
    c.edit(j);
    const std::string msg = test::error_of<ValueError>([&] { parse_metadata(j.dump(), "m.json"); });
    EXPECT_NE(msg.find("checkpoint metadata 'm.json'"), std::string::npos) << c.name << ": " << msg;
    EXPECT_NE(msg.find(c.words), std::string::npos) << c.name << ": " << msg;
  }
}

TEST(Metadata, MalformedOrHostileIsRefusedNamingTheField) {
  expect_refused(
      sample().to_json(),
      {
          {"newer version", [](nlohmann::json& j) { j["version"] = 3; },
           "field 'version' is 3, newer than this build reads (2)"},
          {"other format", [](nlohmann::json& j) { j["format"] = "dcp"; },
           "field 'format' must be"},
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
          {"unknown kind", [](nlohmann::json& j) { j["tensors"][1]["kind"] = "gradient"; },
           "field 'tensors[1].kind' must be \"parameter\" or \"optimizer_state\", got "
           "\"gradient\""},
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
          {"bytes overflow",
           [](nlohmann::json& j) { j["tensors"][0]["shape"] = {int64_t{1} << 62}; },
           "too large in bytes"},
          {"unknown dtype", [](nlohmann::json& j) { j["tensors"][0]["dtype"] = "f128"; },
           "field 'tensors[0].dtype' is not a known dtype"},
          {"byte range overflow",
           [](nlohmann::json& j) { j["tensors"][0]["chunks"][0]["byte_offset"] = INT64_MAX - 4; },
           "field 'tensors[0].chunks[0].byte_length' must be"},
          {"checksum text",
           [](nlohmann::json& j) { j["tensors"][0]["chunks"][0]["xxh64"] = "xyz"; },
           "field 'tensors[0].chunks[0].xxh64' must be 16 lower-case hex digits"},
          {"unknown field", [](nlohmann::json& j) { j["tensors"][0]["owner"] = 1; },
           "field 'tensors[0].owner' is not known"},
          {"v1 field in v2", [](nlohmann::json& j) { j["tensors"][0]["chunks"][0]["offset"] = 0; },
           "field 'tensors[0].chunks[0].offset' is not known"},
          {"missing tensors", [](nlohmann::json& j) { j.erase("tensors"); },
           "field 'tensors' is missing"},
      });
  // Not JSON at all, and a repeated key (which nlohmann would silently resolve).
  EXPECT_THROW(parse_metadata("{\"format\": ", "m.json"), ValueError);
  EXPECT_THROW(parse_metadata(R"({"format": "a", "format": "b"})", "m.json"), ValueError);
}

// Issue 30's table: every way a box can be hostile, refused by its field. Tensor 0 is 'w' [4, 3]:
// chunk 0 is box [0:2, 0:3], chunks 1 and 2 box [2:4, 0:3] split flat at 3; tensor 1 is its
// exp_avg in column blocks [0:4, 0:1] and [0:4, 1:3].
TEST(Metadata, HostileBoxesAreRefusedByField) {
  auto chunk_of = [](nlohmann::json& j, int t, int c) -> nlohmann::json& {
    return j["tensors"][t]["chunks"][c];
  };
  expect_refused(
      sample().to_json(),
      {
          {"negative offset", [&](nlohmann::json& j) { chunk_of(j, 0, 0)["offsets"][1] = -1; },
           "field 'tensors[0].chunks[0].offsets[1]' must be an integer in [0, 2] (dimension 1 of "
           "shape [4, 3]), got -1"},
          {"negative size", [&](nlohmann::json& j) { chunk_of(j, 0, 0)["sizes"][0] = -2; },
           "field 'tensors[0].chunks[0].sizes[0]' must be an integer in [1, 4]"},
          {"empty box", [&](nlohmann::json& j) { chunk_of(j, 1, 0)["sizes"][1] = 0; },
           "field 'tensors[1].chunks[0].sizes[1]' must be an integer in [1, 3]"},
          {"offset overflowing int64",
           [&](nlohmann::json& j) { chunk_of(j, 0, 0)["offsets"][0] = INT64_MAX; },
           "field 'tensors[0].chunks[0].offsets[0]' must be an integer in [0, 3]"},
          {"offset past uint64",
           [&](nlohmann::json& j) { chunk_of(j, 0, 0)["offsets"][0] = UINT64_MAX; },
           "field 'tensors[0].chunks[0].offsets[0]' must be an integer in [0, 3]"},
          {"size overflowing offset + size",
           [&](nlohmann::json& j) { chunk_of(j, 0, 1)["sizes"][0] = INT64_MAX; },
           "field 'tensors[0].chunks[1].sizes[0]' must be an integer in [1, 2]"},
          {"box past the tensor", [&](nlohmann::json& j) { chunk_of(j, 1, 1)["sizes"][1] = 3; },
           "field 'tensors[1].chunks[1].sizes[1]' must be an integer in [1, 2]"},
          {"offset past the tensor",
           [&](nlohmann::json& j) { chunk_of(j, 1, 1)["offsets"][1] = 3; },
           "field 'tensors[1].chunks[1].offsets[1]' must be an integer in [0, 2]"},
          {"offsets of another rank",
           [&](nlohmann::json& j) { chunk_of(j, 0, 0)["offsets"] = {0}; },
           "field 'tensors[0].chunks[0].offsets' must be a list of 2 integer(s), one per "
           "dimension of shape [4, 3], got [0]"},
          {"sizes of another rank",
           [&](nlohmann::json& j) {
             chunk_of(j, 0, 0)["sizes"] = {2, 3, 1};
           },
           "field 'tensors[0].chunks[0].sizes' must be a list of 2 integer(s)"},
          {"offsets not a list", [&](nlohmann::json& j) { chunk_of(j, 0, 0)["offsets"] = "0,0"; },
           "field 'tensors[0].chunks[0].offsets' must be a list"},
          {"offset not an integer",
           [&](nlohmann::json& j) { chunk_of(j, 0, 0)["offsets"][0] = 0.5; },
           "field 'tensors[0].chunks[0].offsets[0]' must be an integer"},
          {"boxes overlap", [&](nlohmann::json& j) { chunk_of(j, 1, 1)["offsets"][1] = 0; },
           "field 'tensors[1].chunks[1].offsets' gives box [0:4, 0:2], which overlaps box "
           "[0:4, 0:1] of chunk 0"},
          {"boxes overlap partly",
           [&](nlohmann::json& j) {
             chunk_of(j, 1, 0)["sizes"][1] = 2;  // [0:4, 0:2] and [0:4, 1:3]
           },
           "field 'tensors[1].chunks[1].offsets' gives box [0:4, 1:3], which overlaps box "
           "[0:4, 0:2] of chunk 0"},
          {"a gap between boxes", [&](nlohmann::json& j) { j["tensors"][1]["chunks"].erase(0); },
           "field 'tensors[1].chunks' leave indices [0, 1) of dimension 1 (size 3) in no chunk"},
          {"a gap at the end", [&](nlohmann::json& j) { chunk_of(j, 1, 1)["sizes"][1] = 1; },
           "field 'tensors[1].chunks' leave indices [2, 3) of dimension 1 (size 3) in no chunk"},
          {"a cell of the grid missing",
           [&](nlohmann::json& j) {
             // [0:2, 0:1], [0:2, 1:3] and [2:4, 1:3]: on one grid, its cell [2:4, 0:1] in no
             // chunk.
             j["tensors"][0]["chunks"] =
                 nlohmann::json::array({chunk_of(j, 1, 0), chunk_of(j, 1, 1), chunk_of(j, 0, 0)});
             for (int c = 0; c < 2; ++c) chunk_of(j, 0, c)["sizes"][0] = 2;
             chunk_of(j, 0, 2)["offsets"] = {2, 1};
             chunk_of(j, 0, 2)["sizes"] = {2, 2};
           },
           "field 'tensors[0].chunks' leave box [2:4, 0:1] of the tensor in no chunk"},
          {"a box off the grid",
           [&](nlohmann::json& j) {
             // [0:2, 0:3], [2:4, 0:1], [2:4, 1:3]: disjoint and covering, not a grid.
             nlohmann::json a = chunk_of(j, 0, 0), b = a, c = a;
             b["offsets"] = {2, 0};
             b["sizes"] = {2, 1};
             c["offsets"] = {2, 1};
             c["sizes"] = {2, 2};
             j["tensors"][0]["chunks"] = nlohmann::json::array({a, b, c});
           },
           "field 'tensors[0].chunks[0].offsets' gives box [0:2, 0:3], which is not on the grid "
           "of the others: along dimension 1 it spans [0, 3), box [2:4, 0:1] of chunk 1 spans "
           "[0, 1)"},
          {"flat range past its box",
           [&](nlohmann::json& j) { chunk_of(j, 0, 2)["flat"]["length"] = 4; },
           "field 'tensors[0].chunks[2].flat.length' must be an integer in [1, 3]"},
          {"flat offset past its box",
           [&](nlohmann::json& j) { chunk_of(j, 0, 2)["flat"]["offset"] = 6; },
           "field 'tensors[0].chunks[2].flat.offset' must be an integer in [0, 5]"},
          {"negative flat offset",
           [&](nlohmann::json& j) { chunk_of(j, 0, 2)["flat"]["offset"] = -1; },
           "field 'tensors[0].chunks[2].flat.offset' must be an integer in [0, 5]"},
          {"empty flat range", [&](nlohmann::json& j) { chunk_of(j, 0, 2)["flat"]["length"] = 0; },
           "field 'tensors[0].chunks[2].flat.length' must be an integer in [1, 3]"},
          {"flat ranges overlap",
           [&](nlohmann::json& j) {
             chunk_of(j, 0, 2)["flat"] = {{"offset", 2}, {"length", 4}};
           },
           "field 'tensors[0].chunks[2].flat' holds elements [2, 3) of box [2:4, 0:3], which "
           "chunk 1 (box [2:4, 0:3] flat [0, 3)) holds too"},
          {"a flat range and its whole box",
           [&](nlohmann::json& j) { chunk_of(j, 0, 1).erase("flat"); },
           "field 'tensors[0].chunks[2].flat' holds elements [3, 6) of box [2:4, 0:3], which "
           "chunk 1 (box [2:4, 0:3]) holds too"},
          {"a gap between flat ranges",
           [&](nlohmann::json& j) {
             chunk_of(j, 0, 2)["flat"] = {{"offset", 4}, {"length", 2}};
           },
           "field 'tensors[0].chunks[2].flat' starts at element 4 of box [2:4, 0:3]: elements "
           "[3, 4) of the box are in no chunk"},
          {"flat ranges short of the box",
           [&](nlohmann::json& j) { chunk_of(j, 0, 2)["flat"]["length"] = 2; },
           "field 'tensors[0].chunks[2].flat' ends at element 5 of box [2:4, 0:3]: elements "
           "[5, 6) of the box are in no chunk"},
          {"unknown field of flat",
           [&](nlohmann::json& j) { chunk_of(j, 0, 2)["flat"]["end"] = 6; },
           "field 'tensors[0].chunks[2].flat.end' is not known"},
          {"flat not an object",
           [&](nlohmann::json& j) {
             chunk_of(j, 0, 2)["flat"] = {3, 3};
           },
           "tensors[0].chunks[2].flat"},
          {"a chunk larger than a chunk may be",
           [&](nlohmann::json& j) {
             j["tensors"][1]["shape"] = {int64_t{1} << 27, 3};
             j["tensors"][1]["chunks"] = nlohmann::json::array({chunk_of(j, 1, 0)});
             chunk_of(j, 1, 0)["sizes"] = {int64_t{1} << 27, 3};
           },
           "field 'tensors[1].chunks[0].sizes' holds 402653184 elements, more than a chunk may "
           "(67108864 of f32, 268435456 bytes)"},
          {"no chunk at all",
           [&](nlohmann::json& j) { j["tensors"][1]["chunks"] = nlohmann::json::array(); },
           "field 'tensors[1].chunks' leave indices [0, 4) of dimension 0 (size 4) in no chunk"},
      });
  // Version 1's own rules, unchanged: ranges of the flattening, in order, tiling it.
  expect_refused(sample_v1(),
                 {
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
                     {"v2 field in v1",
                      [](nlohmann::json& j) {
                        j["tensors"][0]["chunks"][0]["offsets"] = {0, 0};
                      },
                      "field 'tensors[0].chunks[0].offsets' is not known"},
                 });
}

// The layouts of issue 30 tile their tensors; their near misses do not.
TEST(Tiling, EveryShardingsBoxesTileAndNearMissesAreNamed) {
  auto tensor = [](Shape shape, std::vector<std::pair<Box, std::optional<FlatRange>>> regions) {
    TensorInfo t;
    t.name = "t";
    t.shape = std::move(shape);
    for (auto& [box, flat] : regions) t.chunks.push_back(chunk(0, box, flat, 0));
    return t;
  };
  const std::optional<FlatRange> none;
  // A Megatron column block at tp 2, its row split at 4, a q|k|v block of three boxes per rank
  // at tp 2 (rows [0:2], [4:6], [8:10] on rank 0), ZeRO's flat range inside a tp box, a scalar.
  const std::vector<TensorInfo> good = {
      tensor({4, 6}, {{{{0, 0}, {4, 3}}, none}, {{{0, 3}, {4, 3}}, none}}),
      tensor({8, 2}, {{{{0, 0}, {2, 2}}, none},
                      {{{2, 0}, {2, 2}}, none},
                      {{{4, 0}, {2, 2}}, none},
                      {{{6, 0}, {2, 2}}, none}}),
      tensor({12, 3}, {{{{0, 0}, {2, 3}}, none},
                       {{{4, 0}, {2, 3}}, none},
                       {{{8, 0}, {2, 3}}, none},
                       {{{2, 0}, {2, 3}}, none},
                       {{{6, 0}, {2, 3}}, none},
                       {{{10, 0}, {2, 3}}, none}}),
      tensor({4, 6}, {{{{0, 0}, {4, 3}}, FlatRange{0, 5}},
                      {{{0, 0}, {4, 3}}, FlatRange{5, 7}},
                      {{{0, 3}, {4, 3}}, FlatRange{0, 6}},
                      {{{0, 3}, {4, 3}}, FlatRange{6, 6}}}),
      tensor({2, 2}, {{{{0, 0}, {1, 1}}, none},
                      {{{0, 1}, {1, 1}}, none},
                      {{{1, 0}, {1, 1}}, none},
                      {{{1, 1}, {1, 1}}, none}}),
      tensor({}, {{{{}, {}}, none}}),
  };
  for (size_t i = 0; i < good.size(); ++i) {
    const auto e = tiling_error(good[i]);
    EXPECT_FALSE(e.has_value()) << "layout " << i << ": " << e->message;
  }
  struct Bad {
    TensorInfo t;
    std::string words;
  };
  const std::vector<Bad> bad = {
      {tensor({2, 2},
              {{{{0, 0}, {1, 1}}, none}, {{{0, 1}, {1, 1}}, none}, {{{1, 0}, {1, 1}}, none}}),
       "leave box [1:2, 1:2] of the tensor in no chunk"},
      {tensor({}, {}), "leave the tensor (a scalar) in no chunk"},
      {tensor({4}, {{{{0}, {2}}, none}, {{{1}, {3}}, none}}), "overlaps box [0:2]"},
  };
  for (const Bad& b : bad) {
    const auto e = tiling_error(b.t);
    ASSERT_TRUE(e.has_value()) << b.words;
    EXPECT_NE(e->message.find(b.words), std::string::npos) << e->message;
  }
}

}  // namespace
}  // namespace acc::ckpt
