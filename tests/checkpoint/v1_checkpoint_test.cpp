// A checkpoint of format version 1, written by the previous release
// (tests/checkpoint/data/README.md: a tiny GPT, 2 ranks of zero2, 2 steps), loads with today's code
// into 1 and 2 ranks: its parameters equal that release's own safetensors export bitwise, and its
// optimizer state equals, bitwise, the state decoded straight from its chunks (decode_chunk alone,
// by version 1's rule: each chunk a range of its tensor's flattening), which is also what a load
// into the saving layout holds.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>

#include "acc/checkpoint/checkpoint.hpp"
#include "acc/dist/dist.hpp"
#include "acc/io/safetensors.hpp"
#include "acc/models/models.hpp"
#include "acc/optim/adam.hpp"
#include "acc/strategies/strategy.hpp"
#include "acc/trace/estimate.hpp"
#include "acc/util/json.hpp"
#include "helpers.hpp"

namespace acc::ckpt {
namespace {

namespace fs = std::filesystem;

const std::string kData = ACC_CKPT_DATA_DIR;
const std::string kStep = kData + "/v1_gpt_zero2/step-00000002";

// Every tensor of the checkpoint from its chunks, decoded one by one into its flattening at the
// chunk's own range: the version-1 reading, independent of the load planner.
std::map<std::string, Tensor> decode_v1(const std::string& dir) {
  const std::string text = StepFile::open(dir, "metadata.json").read_all();
  const nlohmann::json j = parse_json(text, "v1 metadata");
  std::map<std::string, Tensor> out;
  std::vector<char> stored, raw;
  for (const auto& t : j.at("tensors")) {
    const Shape shape = t.at("shape").get<Shape>();
    const DType dtype = parse_dtype(t.at("dtype").get<std::string>());
    Tensor whole = zeros({numel_of(shape)}, {dtype});
    const size_t es = element_size(dtype);
    for (const auto& c : t.at("chunks")) {
      ChunkInfo ci;
      ci.box = dist::Box::whole(shape);
      ci.flat = dist::FlatRange{c.at("offset"), c.at("length")};
      ci.byte_offset = c.at("byte_offset");
      ci.byte_length = c.at("byte_length");
      ci.xxh64 = std::stoull(c.at("xxh64").get<std::string>(), nullptr, 16);
      const StepFile f =
          StepFile::open(dir, j.at("files").at(c.at("file").get<size_t>()).get<std::string>());
      stored.resize(static_cast<size_t>(ci.byte_length));
      f.read_at(ci.byte_offset, stored.data(), ci.byte_length);
      decode_chunk(stored.data(), stored.size(), ci, dtype, "v1", raw);
      std::memcpy(static_cast<char*>(whole.raw_data()) + ci.flat->offset * es, raw.data(),
                  raw.size());
    }
    out[t.at("name").get<std::string>()] = whole;
  }
  return out;
}

std::unique_ptr<strategies::Trainer> trainer(const nlohmann::json& config,
                                             const std::string& method, dist::ProcessGroupPtr g) {
  const std::string s = method.empty() ? "[]" : R"([{"name": ")" + method + R"("}])";
  return strategies::apply(models::create_model("gpt", config), optim::AdamW::factory({}),
                           strategies::parse_strategy(nlohmann::json::parse(s)),
                           {.context = nullptr, .group = g});
}

TEST(Version1, APreviousReleasesCheckpointLoadsBitwise) {
  auto world = dist::ProcessGroup::world();
  const int W = world->size(), rank = world->rank();
  for (int n = 1; n <= W; ++n) test::first(n);
  const Metadata meta = read_metadata(kStep);
  ASSERT_EQ(meta.version, 1);
  ASSERT_EQ(meta.world, 2);
  const nlohmann::json config = read_json_file(kData + "/tiny_gpt.json", "tiny_gpt.json");
  const std::string hash = trace::model_trace_hash("gpt", config);
  EXPECT_EQ(meta.model_trace_hash, hash) << "the model's trace hash has changed since 00ff801";
  // A tensor split over the two shards: the test reads flat ranges of two files.
  const TensorInfo* split = meta.find("state.transformer.wte.weight.exp_avg");
  ASSERT_NE(split, nullptr);
  ASSERT_EQ(split->chunks.size(), 2u);
  EXPECT_EQ(split->chunks[1].file, 1);
  EXPECT_EQ(split->chunks[1].flat, (dist::FlatRange{16, 2032}));

  const std::map<std::string, Tensor> decoded = decode_v1(kStep);
  ASSERT_EQ(decoded.size(), meta.tensors.size());
  // The parameters, decoded, are that release's export bitwise.
  const io::SafetensorsFile exported = io::load_safetensors(kData + "/v1_gpt_zero2.safetensors");
  size_t params = 0;
  for (const auto& [name, t] : exported.tensors) {
    ASSERT_EQ(decoded.count(name), 1u) << name;
    ASSERT_EQ(t.nbytes(), decoded.at(name).nbytes()) << name;
    EXPECT_EQ(std::memcmp(t.contiguous().raw_data(), decoded.at(name).raw_data(), t.nbytes()), 0)
        << name;
    ++params;
  }
  EXPECT_EQ(params, 28u);
  // Read whole with today's load: the same.
  const std::map<std::string, Tensor> whole = test::read_whole(kStep);
  for (const auto& [name, t] : decoded) {
    EXPECT_EQ(std::memcmp(t.raw_data(), whole.at(name).raw_data(), t.nbytes()), 0) << name;
  }
  // Into 1 and 2 ranks, each data-parallel method (the saving layout, 2 x zero2, among them):
  // every region of parameters and state as decoded, and the step counts of the checkpoint.
  const std::vector<std::pair<int, std::string>> layouts = {
      {1, ""}, {2, "ddp"}, {2, "zero1"}, {2, "zero2"}, {2, "fsdp"}};
  int loads = 0;
  for (const auto& [dst, method] : layouts) {
    if (dst > W || rank >= dst) continue;
    const std::string what = std::to_string(dst) + " x " + (method.empty() ? "none" : method);
    auto t = trainer(config, method, test::first(dst));
    const Metadata m = load_trainer(kStep, *t, hash);
    EXPECT_EQ(m.step, 2) << what;
    test::expect_holds(*t, decoded, what);
    for (const std::string& name : t->optimizer().param_names()) {
      EXPECT_EQ(t->optimizer().param_step(name), 2) << what << ": " << name;
    }
    ++loads;
  }
  if (rank == 0) {
    EXPECT_EQ(loads, W >= 2 ? 5 : 1);
  }
  world->barrier()->wait();
}

// The version-1 checkpoint read and saved again is a version-2 checkpoint of the same tensors.
TEST(Version1, ResavedItIsVersion2WithTheSameTensors) {
  auto world = dist::ProcessGroup::world();
  const std::string base = test::job_dir("v1-resave");
  const nlohmann::json config = read_json_file(kData + "/tiny_gpt.json", "tiny_gpt.json");
  const std::string hash = trace::model_trace_hash("gpt", config);
  auto t = trainer(config, world->size() > 1 ? "zero2" : "", world);
  load_trainer(kStep, *t, hash);
  const std::string dir = save_trainer(base, 2, *t, hash);
  EXPECT_EQ(read_metadata(dir).version, 2);
  const auto again = test::read_whole(dir), before = test::read_whole(kStep);
  ASSERT_EQ(again.size(), before.size());
  for (const auto& [name, tensor] : before) {
    EXPECT_EQ(std::memcmp(tensor.raw_data(), again.at(name).raw_data(), tensor.nbytes()), 0)
        << name;
  }
  test::remove_job_dir(base);
}

}  // namespace
}  // namespace acc::ckpt
