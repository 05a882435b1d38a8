// Machine calibration: the fingerprint, the GEMM and memory figures, the cache file, and the GEMMs
// read from a traced step. Measurements are only checked for sanity (finite, positive, not absurd):
// the machine is shared and its figures vary from run to run.
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include "acc/models/models.hpp"
#include "acc/search/calibration.hpp"
#include "acc/tensor/random.hpp"
#include "acc/tensor/threading.hpp"
#include "acc/trace/passes.hpp"
#include "acc/util/error.hpp"

namespace acc::search {
namespace {

namespace fs = std::filesystem;

constexpr double kFast = 0.005;  // seconds per point in tests

// Runs `fn` and returns the acc::ValueError message it throws ("" and a failure if none).
template <class F>
std::string value_error(F&& fn) {
  try {
    fn();
  } catch (const ValueError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no acc::ValueError thrown";
  return "";
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_file(const fs::path& p, const std::string& text) {
  std::ofstream(p) << text;
}

// A cache directory of its own per test, removed afterwards.
class CacheDir : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("acc_calibration_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    options_.seconds_per_point = kFast;
    options_.cache_dir = dir_.string();
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
  CalibrationOptions options_;
};

// ---- fingerprint ----

TEST(HardwareFingerprint, IsStableAcrossCallsAndRoundTripsThroughJson) {
  const HardwareFingerprint a = hardware_fingerprint(), b = hardware_fingerprint();
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.key(), b.key());
  EXPECT_EQ(a.key().size(), 16u);
  EXPECT_EQ(a.key().find_first_not_of("0123456789abcdef"), std::string::npos) << a.key();
  EXPECT_FALSE(a.cpu_model.empty());
  EXPECT_GE(a.cores, 1);
  EXPECT_GE(a.memory_gib, 1);
  EXPECT_FALSE(a.blas_core.empty());
  EXPECT_FALSE(a.autoacc_version.empty());
  // This test's own build: optimised or not, and a sanitizer named after a '+'.
  EXPECT_TRUE(a.build.rfind("optimized", 0) == 0 || a.build.rfind("unoptimized", 0) == 0)
      << a.build;

  const HardwareFingerprint back = HardwareFingerprint::from_json(a.to_json());
  EXPECT_EQ(back, a);
  EXPECT_EQ(back.key(), a.key());
  // A file written before the build was named reads as another build, not as an error.
  nlohmann::json older = a.to_json();
  older.erase("build");
  const HardwareFingerprint old = HardwareFingerprint::from_json(older);
  EXPECT_EQ(old.build, "");
  EXPECT_EQ(a.difference(old).rfind("build: ", 0), 0u) << a.difference(old);
  // Through text, as the cache stores it.
  EXPECT_EQ(HardwareFingerprint::from_json(nlohmann::json::parse(a.to_json().dump())).key(),
            a.key());
}

TEST(HardwareFingerprint, EveryFieldChangesTheKeyAndIsNamedAsTheDifference) {
  const HardwareFingerprint a = hardware_fingerprint();
  std::vector<std::pair<std::string, HardwareFingerprint>> changed(8, {"", a});
  changed[0].first = "cpu_model", changed[0].second.cpu_model += "x";
  changed[1].first = "isa", changed[1].second.isa.push_back("avx512_fp16");
  changed[2].first = "cores", changed[2].second.cores += 1;
  changed[3].first = "memory_gib", changed[3].second.memory_gib += 1;
  changed[4].first = "blas_core", changed[4].second.blas_core += "x";
  changed[5].first = "blas_config", changed[5].second.blas_config += "x";
  changed[6].first = "autoacc_version", changed[6].second.autoacc_version += ".1";
  changed[7].first = "build", changed[7].second.build += "+asan";
  for (const auto& [field, other] : changed) {
    EXPECT_NE(other.key(), a.key()) << field;
    EXPECT_EQ(a.difference(other).rfind(field + ": ", 0), 0u) << a.difference(other);
  }
  EXPECT_EQ(a.difference(a), "");
}

TEST(HardwareFingerprint, MalformedJsonNamesTheField) {
  const nlohmann::json good = hardware_fingerprint().to_json();
  struct Case {
    std::string field;
    nlohmann::json value;  // null: remove the field
    std::string words;
  };
  const std::vector<Case> cases = {
      {"cores", nullptr, "field 'cores' is missing"},
      {"cores", "2", "field 'cores' must be an integer"},
      {"cores", 0, "field 'cores' must be an integer in [1,"},
      {"memory_gib", -1, "field 'memory_gib'"},
      {"cpu_model", 3, "field 'cpu_model' must be a string"},
      {"isa", "avx2", "field 'isa' must be a list"},
      {"isa", nlohmann::json::array({"avx2", 1}), "field 'isa[1]' must be a string"},
      {"autoacc_version", nullptr, "field 'autoacc_version' is missing"},
      {"build", 3, "field 'build' must be a string"},
      {"colour", "blue", "field 'colour' is not known"},
  };
  for (const Case& c : cases) {
    nlohmann::json j = good;
    if (c.value.is_null()) {
      j.erase(c.field);
    } else {
      j[c.field] = c.value;
    }
    const std::string msg = value_error([&] { HardwareFingerprint::from_json(j); });
    EXPECT_NE(msg.find("hardware fingerprint: " + c.words), std::string::npos)
        << c.field << ": " << msg;
  }
  EXPECT_NE(value_error([] {
              HardwareFingerprint::from_json(nlohmann::json::array());
            }).find("expected a JSON object"),
            std::string::npos);
}

// ---- MachineCalibration without measuring ----

MachineCalibration hand_made() {
  MachineCalibration c;
  c.hardware = hardware_fingerprint();
  c.threads = 1;
  c.gemm_threading = "openblas";
  c.memory_gbps = 10;
  c.gemm_gflops[{64, 64, 64}] = 10;
  c.gemm_gflops[{1024, 1024, 1024}] = 50;
  c.gemm_gflops[{1024, 1024, 1024, false, true}] = 40;
  return c;
}

TEST(MachineCalibration, JsonRoundTripIsExact) {
  MachineCalibration c = hand_made();
  c.gemm_gflops[{2048, 2304, 768, false, true}] = 33.612345678901234;
  c.memory_gbps = 9.123456789012345;
  c.contention = {{2, 1.0734567890123}, {4, 2.25}};
  const MachineCalibration back =
      MachineCalibration::from_json(nlohmann::json::parse(c.to_json().dump()));
  EXPECT_EQ(back.hardware, c.hardware);
  EXPECT_EQ(back.threads, c.threads);
  EXPECT_EQ(back.gemm_threading, c.gemm_threading);
  EXPECT_EQ(back.gemm_operands, "cold");
  EXPECT_EQ(back.gemm_gflops, c.gemm_gflops);
  EXPECT_EQ(back.memory_gbps, c.memory_gbps);
  EXPECT_EQ(back.contention, c.contention);
  // A file written before the contention factors existed is still read.
  nlohmann::json older = hand_made().to_json();
  ASSERT_FALSE(older.contains("contention"));
  EXPECT_TRUE(MachineCalibration::from_json(older).contention.empty());
  // One written before the GEMMs were timed on cold operands timed them on hot ones.
  older.erase("gemm_operands");
  EXPECT_EQ(MachineCalibration::from_json(older).gemm_operands, "hot");
}

TEST(MachineCalibration, MalformedOrTruncatedJsonNamesTheField) {
  MachineCalibration made = hand_made();
  made.contention = {{2, 1.5}};
  const nlohmann::json good = made.to_json();
  struct Case {
    std::string name;
    std::function<void(nlohmann::json&)> edit;
    std::string words;
  };
  const std::vector<Case> cases = {
      {"no gemm (truncated)", [](nlohmann::json& j) { j.erase("gemm"); },
       "field 'gemm' is missing"},
      {"no hardware", [](nlohmann::json& j) { j.erase("hardware"); },
       "field 'hardware' is missing"},
      {"hardware field", [](nlohmann::json& j) { j["hardware"].erase("blas_core"); },
       "field 'hardware.blas_core' is missing"},
      {"hardware type", [](nlohmann::json& j) { j["hardware"] = 3; },
       "field 'hardware' must be an object"},
      {"threads", [](nlohmann::json& j) { j["threads"] = 0; }, "field 'threads' must be"},
      {"gemm_threading", [](nlohmann::json& j) { j["gemm_threading"] = "omp"; },
       "field 'gemm_threading' must be \"openblas\" or \"tbb\""},
      {"gemm_operands", [](nlohmann::json& j) { j["gemm_operands"] = "warm"; },
       "field 'gemm_operands' must be \"hot\" or \"cold\", got \"warm\""},
      {"memory", [](nlohmann::json& j) { j["memory_gbps"] = 0; },
       "field 'memory_gbps' must be a finite number > 0"},
      {"gemm type", [](nlohmann::json& j) { j["gemm"] = nlohmann::json::object(); },
       "field 'gemm' must be a list"},
      {"gflops", [](nlohmann::json& j) { j["gemm"][1]["gflops"] = -1; },
       "field 'gemm[1].gflops' must be a finite number > 0, got -1"},
      {"gflops text", [](nlohmann::json& j) { j["gemm"][0]["gflops"] = "fast"; },
       "field 'gemm[0].gflops'"},
      {"m", [](nlohmann::json& j) { j["gemm"][2]["m"] = 0; }, "field 'gemm[2].m' must be"},
      {"k missing", [](nlohmann::json& j) { j["gemm"][0].erase("k"); },
       "field 'gemm[0].k' is missing"},
      {"trans", [](nlohmann::json& j) { j["gemm"][0]["trans_b"] = 1; },
       "field 'gemm[0].trans_b' must be true or false"},
      {"repeat", [](nlohmann::json& j) { j["gemm"].push_back(j["gemm"][0]); },
       "field 'gemm[3]' repeats the shape 64x64x64 NN"},
      {"overflow",
       [](nlohmann::json& j) {
         for (const char* d : {"m", "n", "k"}) j["gemm"][0][d] = int64_t{1} << 40;
       },
       "field 'gemm[0]' has FLOPs that overflow 64 bits"},
      {"unknown", [](nlohmann::json& j) { j["gemm"][0]["l"] = 1; },
       "field 'gemm[0].l' is not known"},
      {"contention type", [](nlohmann::json& j) { j["contention"] = 2; },
       "field 'contention' must be a list"},
      {"contention factor", [](nlohmann::json& j) { j["contention"][0]["factor"] = 0.5; },
       "field 'contention[0].factor' must be a finite number >= 1"},
      {"contention ranks", [](nlohmann::json& j) { j["contention"][0]["local_ranks"] = 1; },
       "field 'contention[0].local_ranks' must be"},
      {"contention repeat",
       [](nlohmann::json& j) { j["contention"].push_back(j["contention"][0]); },
       "field 'contention[1]' repeats local_ranks 2"},
  };
  for (const Case& c : cases) {
    nlohmann::json j = good;
    c.edit(j);
    const std::string msg = value_error([&] { MachineCalibration::from_json(j); });
    EXPECT_NE(msg.find("machine calibration: " + c.words), std::string::npos)
        << c.name << ": " << msg;
  }
}

TEST(MachineCalibration, GemmSecondsUsesTheShapeOrTheNearestMeasuredOne) {
  const MachineCalibration c = hand_made();
  const double big = 2.0 * 1024 * 1024 * 1024;
  // Measured: exactly its FLOPs at its throughput, in its layout.
  EXPECT_DOUBLE_EQ(c.gemm_seconds(1024, 1024, 1024), big / 50e9);
  EXPECT_DOUBLE_EQ(c.gemm_seconds({1024, 1024, 1024, false, true}), big / 40e9);
  // A layout not measured takes the same m, n, k in another layout: 1024^3 TN -> NN's 50
  // (NN before NT in the shape order, both equally near).
  EXPECT_DOUBLE_EQ(c.gemm_seconds({1024, 1024, 1024, true, false}), big / 50e9);
  // Nearest by log(m n k): 512^3 is 3 log 2 from 1024^3 and 6 log 2 from 64^3.
  EXPECT_DOUBLE_EQ(c.gemm_seconds(512, 512, 512), 2.0 * 512 * 512 * 512 / 50e9);
  EXPECT_DOUBLE_EQ(c.gemm_seconds(128, 128, 128), 2.0 * 128 * 128 * 128 / 10e9);
  // Same volume as 1024^3 but another aspect: still the 1024^3 figure (volume first).
  EXPECT_DOUBLE_EQ(c.gemm_seconds(4096, 1024, 256), big / 50e9);
  EXPECT_EQ(c.gemm_seconds(0, 10, 10), 0.0);
  EXPECT_NE(value_error([&] { c.gemm_seconds(-1, 2, 3); }).find("m=-1"), std::string::npos);
  EXPECT_NE(value_error([] {
              MachineCalibration().gemm_seconds(8, 8, 8);
            }).find("no GEMM shape was measured"),
            std::string::npos);

  EXPECT_DOUBLE_EQ(c.memory_seconds(int64_t{10} << 30), double(int64_t{10} << 30) / 10e9);
  EXPECT_EQ(c.memory_seconds(0), 0.0);
  EXPECT_NE(value_error([&] { c.memory_seconds(-5); }).find("-5"), std::string::npos);
  EXPECT_NE(value_error([] { MachineCalibration().memory_seconds(5); }).find("memory_gbps = 0"),
            std::string::npos);
}

// GemmShape::flops: 2 m n k, and a product past 64 bits is an error naming the shape.
TEST(GemmShape, FlopsNameTheShapeWhenTheyOverflow) {
  EXPECT_EQ((GemmShape{2048, 2304, 768}.flops()), int64_t{2} * 2048 * 2304 * 768);
  try {
    (void)GemmShape{int64_t{1} << 30, int64_t{1} << 30, 16, true, false}.flops();
    ADD_FAILURE() << "no overflow reported";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("FLOPs of GEMM 1073741824x1073741824x16 TN"),
              std::string::npos)
        << e.what();
  }
}

// ---- measuring ----

TEST(CalibrateMachine, GivesSaneFiguresAndLeavesThreadsAndRngAsTheyWere) {
  const int threads_before = get_num_threads();
  const uint64_t rng_before = default_generator().offset();
  const GemmShape small{64, 64, 64}, big{256, 512, 256, false, true};
  CalibrationOptions o;
  o.seconds_per_point = kFast;
  const MachineCalibration c = calibrate_machine({small, big, small}, o);
  EXPECT_EQ(get_num_threads(), threads_before);
  EXPECT_EQ(default_generator().offset(), rng_before);

  EXPECT_EQ(c.hardware, hardware_fingerprint());
  EXPECT_EQ(c.threads, 1);
  ASSERT_EQ(c.gemm_gflops.size(), 2u);
  for (const auto& [shape, gflops] : c.gemm_gflops) {
    EXPECT_TRUE(std::isfinite(gflops)) << shape.str();
    EXPECT_GT(gflops, 0.1) << shape.str();
  }
  // Per FLOP a bigger GEMM is not absurdly slower than a small one (it is usually faster).
  const double per_flop_small = c.gemm_seconds(small) / static_cast<double>(small.flops());
  const double per_flop_big = c.gemm_seconds(big) / static_cast<double>(big.flops());
  EXPECT_LT(per_flop_big, 10 * per_flop_small);
  EXPECT_TRUE(std::isfinite(c.memory_gbps));
  EXPECT_GT(c.memory_gbps, 0.1);
  EXPECT_EQ(c.source.gemm_measured, 2);
  EXPECT_EQ(c.source.gemm_from_cache, 0);
  EXPECT_GT(c.source.seconds, 0);
}

TEST(CalibrateMachine, RefusesBadOptionsAndShapes) {
  CalibrationOptions o;
  o.threads = 0;
  EXPECT_NE(value_error([&] {
              calibrate_machine({{8, 8, 8}}, o);
            }).find("threads"),
            std::string::npos);
  o = {};
  o.seconds_per_point = 0;
  EXPECT_NE(value_error([&] {
              calibrate_machine({{8, 8, 8}}, o);
            }).find("seconds_per_point"),
            std::string::npos);
  o = {};
  EXPECT_NE(value_error([&] {
              calibrate_machine({{8, 0, 8}}, o);
            }).find("8x0x8"),
            std::string::npos);
}

// ---- the cache ----

TEST_F(CacheDir, SecondCallTakesEveryShapeFromTheCacheAndAMissingOneIsAdded) {
  const std::vector<GemmShape> shapes{{32, 32, 32}, {64, 32, 16, true, false}};
  const MachineCalibration first = load_or_calibrate_machine(shapes, options_);
  const fs::path path = machine_cache_path(options_);
  EXPECT_EQ(path.parent_path(), dir_);
  EXPECT_EQ(path.filename().string(), "machine-" + hardware_fingerprint().key() + "-t1.json");
  ASSERT_TRUE(fs::exists(path));
  EXPECT_EQ(first.source.gemm_measured, 2);
  EXPECT_EQ(first.source.gemm_from_cache, 0);
  EXPECT_FALSE(first.source.memory_from_cache);
  EXPECT_EQ(first.source.cache_file, path.string());
  const std::string text = read_file(path);

  const MachineCalibration second = load_or_calibrate_machine(shapes, options_);
  EXPECT_EQ(second.source.gemm_measured, 0);
  EXPECT_EQ(second.source.gemm_from_cache, 2);
  EXPECT_TRUE(second.source.memory_from_cache);
  EXPECT_EQ(second.gemm_gflops, first.gemm_gflops);
  EXPECT_EQ(second.memory_gbps, first.memory_gbps);
  EXPECT_EQ(read_file(path), text) << "nothing measured, nothing written";

  const GemmShape extra{48, 48, 48};
  const MachineCalibration third = load_or_calibrate_machine({shapes[0], extra}, options_);
  EXPECT_EQ(third.source.gemm_measured, 1);
  EXPECT_EQ(third.source.gemm_from_cache, 1);
  EXPECT_TRUE(third.source.memory_from_cache);
  EXPECT_EQ(third.memory_gbps, first.memory_gbps);
  EXPECT_EQ(third.gemm_gflops.at(shapes[0]), first.gemm_gflops.at(shapes[0]));
  const MachineCalibration stored =
      MachineCalibration::from_json(nlohmann::json::parse(read_file(path)));
  EXPECT_EQ(stored.gemm_gflops.size(), 3u) << "the shapes of the file not asked for are kept";
  EXPECT_EQ(stored.gemm_gflops.count(extra), 1u);
  // No temporary file left beside it.
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir_)) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
}

TEST_F(CacheDir, ACacheOfAnotherMachineIsReplaced) {
  const std::vector<GemmShape> shapes{{32, 32, 32}};
  MachineCalibration other = hand_made();
  other.hardware.cores += 3;
  other.memory_gbps = 12345;
  fs::create_directories(dir_);
  const fs::path path = machine_cache_path(options_);
  write_file(path, other.to_json().dump());

  const MachineCalibration c = load_or_calibrate_machine(shapes, options_);
  EXPECT_EQ(c.source.gemm_measured, 1);
  EXPECT_EQ(c.source.gemm_from_cache, 0);
  EXPECT_FALSE(c.source.memory_from_cache);
  EXPECT_NE(c.source.note.find("another machine (cores: "), std::string::npos) << c.source.note;
  EXPECT_NE(c.memory_gbps, 12345);
  const MachineCalibration stored =
      MachineCalibration::from_json(nlohmann::json::parse(read_file(path)));
  EXPECT_EQ(stored.hardware, hardware_fingerprint());
  EXPECT_EQ(stored.gemm_gflops.size(), 1u) << "the other machine's shapes are not kept";
}

// A cache whose GEMMs were timed on the same operands at every call (before 2026-11-29) is
// measured again: its figures are faster than a step's GEMMs. The file is this machine's own (this
// process's threads and GEMM threading), with the field changed.
TEST_F(CacheDir, ACacheOfGemmsTimedOnHotOperandsIsReplaced) {
  const std::vector<GemmShape> shapes{{32, 32, 32}};
  (void)load_or_calibrate_machine(shapes, options_);
  const fs::path path = machine_cache_path(options_);
  nlohmann::json hot = nlohmann::json::parse(read_file(path));
  ASSERT_EQ(hot.at("gemm_operands"), "cold");
  hot["gemm_operands"] = "hot";
  hot["gemm"][0]["gflops"] = 12345;
  write_file(path, hot.dump());

  const MachineCalibration c = load_or_calibrate_machine(shapes, options_);
  EXPECT_EQ(c.source.gemm_measured, 1);
  EXPECT_EQ(c.source.gemm_from_cache, 0);
  EXPECT_NE(c.source.note.find("timed its GEMMs on hot operands, this build on cold ones"),
            std::string::npos)
      << c.source.note;
  EXPECT_NE(c.gemm_gflops.at(shapes[0]), 12345);
  EXPECT_EQ(MachineCalibration::from_json(nlohmann::json::parse(read_file(path))).gemm_operands,
            "cold");
}

TEST_F(CacheDir, ACorruptCacheIsAnErrorNamingTheFileAndIsLeftAlone) {
  const std::vector<GemmShape> shapes{{32, 32, 32}};
  fs::create_directories(dir_);
  const fs::path path = machine_cache_path(options_);
  MachineCalibration mine = hand_made();
  const std::string good = mine.to_json().dump(2);

  // Truncated text.
  const std::string truncated = good.substr(0, good.size() / 2);
  write_file(path, truncated);
  std::string msg = value_error([&] { load_or_calibrate_machine(shapes, options_); });
  EXPECT_NE(msg.find(path.string()), std::string::npos) << msg;
  EXPECT_EQ(read_file(path), truncated);

  // Whole JSON, one field wrong.
  nlohmann::json j = mine.to_json();
  j["gemm"][0]["gflops"] = -1;
  write_file(path, j.dump());
  msg = value_error([&] { load_or_calibrate_machine(shapes, options_); });
  EXPECT_NE(msg.find("machine calibration cache '" + path.string() + "'"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("field 'gemm[0].gflops'"), std::string::npos) << msg;
  EXPECT_EQ(read_file(path), j.dump());

  // A file named for 1 thread that says 2.
  j = mine.to_json();
  j["threads"] = 2;
  write_file(path, j.dump());
  msg = value_error([&] { load_or_calibrate_machine(shapes, options_); });
  EXPECT_NE(msg.find("field 'threads' is 2 in a file named for 1 threads"), std::string::npos)
      << msg;
}

TEST_F(CacheDir, ACacheThatCannotBeWrittenIsAWarningAndTheFiguresAreReturned) {
  fs::create_directories(dir_);
  write_file(dir_ / "file", "a file, not a directory");
  options_.cache_dir = (dir_ / "file" / "cache").string();
  const MachineCalibration c = load_or_calibrate_machine({{32, 32, 32}}, options_);
  EXPECT_EQ(c.source.gemm_measured, 1);
  EXPECT_GT(c.gemm_gflops.at({32, 32, 32}), 0);
  EXPECT_GT(c.memory_gbps, 0);
  EXPECT_NE(c.source.note.find("not saved: "), std::string::npos) << c.source.note;
  EXPECT_NE(c.source.note.find(options_.cache_dir), std::string::npos) << c.source.note;
}

TEST(CalibrationCache, DefaultDirectoryFollowsTheEnvironment) {
  const char* saved = std::getenv("ACC_CACHE_DIR");
  const std::string keep = saved ? saved : "";
  ::setenv("ACC_CACHE_DIR", "/tmp/acc-cache-here", 1);
  EXPECT_EQ(default_cache_dir(), "/tmp/acc-cache-here");
  CalibrationOptions o;
  o.threads = 2;
  EXPECT_EQ(machine_cache_path(o),
            "/tmp/acc-cache-here/machine-" + hardware_fingerprint().key() + "-t2.json");
  ::unsetenv("ACC_CACHE_DIR");
  if (std::getenv("HOME") != nullptr && std::getenv("XDG_CACHE_HOME") == nullptr) {
    EXPECT_EQ(default_cache_dir(), std::string(std::getenv("HOME")) + "/.cache/autoacc");
  }
  if (saved) ::setenv("ACC_CACHE_DIR", keep.c_str(), 1);
}

// ---- GEMMs of a traced step ----

models::GPTConfig tiny_gpt() {
  models::GPTConfig c;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 64;
  c.vocab_size = 128;
  c.block_size = 64;
  return c;
}

std::map<GemmShape, std::pair<int64_t, int64_t>> by_shape(const std::vector<GemmCount>& counts) {
  std::map<GemmShape, std::pair<int64_t, int64_t>> m;
  for (const GemmCount& c : counts) m[c.shape] = {c.forward, c.backward};
  return m;
}

int64_t gemm_flops(const std::vector<GemmCount>& counts) {
  int64_t total = 0;
  for (const GemmCount& c : counts) total += c.shape.flops() * (c.forward + c.backward);
  return total;
}

// FLOPs of the fused attention ops (forward and backward), which are not GEMMs.
int64_t attention_flops(const trace::Trace& t) {
  int64_t total = 0;
  for (trace::VertexId v : t.graph.ops()) {
    const trace::Vertex& vx = t.graph.vertex(v);
    if (vx.op == "Attention" || vx.op == "AttentionBackward") total += vx.flops;
  }
  return total;
}

TEST(GemmShapes, OfATracedGptListTheLinearsInEachLayout) {
  models::GPT gpt(tiny_gpt());
  const int64_t B = 2, T = 16, C = 64, V = 128, L = 2, BT = B * T;
  const Tensor idx = randint(0, V, {B, T});
  const trace::Trace t = trace::trace(gpt, {idx, idx});
  const std::vector<GemmCount> counts = gemm_counts(t);
  // Forward y = x w^T (NT) per linear; backward dx = g w (NN) and dw = g^T x (TN).
  // (rows, out, in) of c_attn, attn.c_proj, c_fc, mlp.c_proj, the lm_head (tied to wte).
  const std::vector<std::array<int64_t, 4>> linears = {
      {BT, 3 * C, C, L}, {BT, C, C, L}, {BT, 4 * C, C, L}, {BT, C, 4 * C, L}, {BT, V, C, 1}};
  std::map<GemmShape, std::pair<int64_t, int64_t>> expected;
  for (const auto& [M, OUT, IN, n] : linears) {
    expected[{M, OUT, IN, false, true}].first += n;
    expected[{M, IN, OUT, false, false}].second += n;
    expected[{OUT, IN, M, true, false}].second += n;
  }
  EXPECT_EQ(by_shape(counts), expected);
  std::vector<GemmShape> shapes;
  for (const auto& [s, n] : expected) shapes.push_back(s);
  EXPECT_EQ(gemm_shapes(t), shapes);
  // Every FLOP of the step is in a GEMM or in the fused attention.
  EXPECT_GT(attention_flops(t), 0);
  EXPECT_EQ(gemm_flops(counts) + attention_flops(t), trace::estimate_compute(t).total());
}

TEST(GemmShapes, CountRecomputedForwardsInBackward) {
  models::GPT gpt(tiny_gpt());
  const Tensor idx = randint(0, 128, {2, 16});
  const trace::Trace t = trace::trace(gpt, {idx, idx}, {.recompute = trace::Recompute::kBlock});
  const auto m = by_shape(gemm_counts(t));
  // c_attn runs twice forward and, recomputed, twice more in backward; the lm_head (outside the
  // blocks) is not recomputed.
  EXPECT_EQ(m.at(GemmShape{32, 192, 64, false, true}), std::make_pair(int64_t{2}, int64_t{2}));
  EXPECT_EQ(m.at(GemmShape{32, 128, 64, false, true}), std::make_pair(int64_t{1}, int64_t{0}));
  EXPECT_EQ(gemm_flops(gemm_counts(t)) + attention_flops(t), trace::estimate_compute(t).total());
}

TEST(GemmShapes, OfTheReferenceAttentionListItsBatchedProducts) {
  models::GPT gpt(tiny_gpt());
  gpt.set_fused_attention(false);
  const int64_t B = 2, T = 32, NH = 4, HS = 16;
  const Tensor idx = randint(0, 128, {B, T});
  const trace::Trace t = trace::trace(gpt, {idx, idx});
  const auto counts = gemm_counts(t);
  const auto m = by_shape(counts);
  const int64_t per_layer = B * NH, layers = 2;
  // scores q k^T: (T, T, HS); values att v: (T, HS, T); one product per (batch, head).
  EXPECT_EQ(m.at(GemmShape{T, T, HS}).first, per_layer * layers);
  EXPECT_EQ(m.at(GemmShape{T, HS, T}).first, per_layer * layers);
  // Backward of the scores: dq = G k (T, HS, T) NT, dk^T = q^T G (HS, T, T) TN.
  EXPECT_EQ(m.at(GemmShape{T, HS, T, false, true}).second, per_layer * layers);
  EXPECT_EQ(m.at(GemmShape{HS, T, T, true, false}).second, per_layer * layers);
  // Without the fused attention every FLOP of the step is a GEMM's.
  EXPECT_EQ(gemm_flops(counts), trace::estimate_compute(t).total());
}

}  // namespace
}  // namespace acc::search
