// The machine's calibration: fingerprint, GEMM and memory measurements, the cache file.

#include "acc/search/calibration.hpp"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <tuple>

#include "acc/autograd/ops.hpp"
#include "acc/dist/agreement.hpp"
#include "acc/dist/dist.hpp"
#include "acc/dist/node.hpp"
#include "acc/tensor/kernels.hpp"
#include "acc/tensor/random.hpp"
#include "acc/tensor/threading.hpp"
#include "acc/util/checked.hpp"
#include "acc/util/env.hpp"
#include "acc/util/error.hpp"
#include "acc/util/file.hpp"
#include "acc/util/hash.hpp"
#include "acc/util/json.hpp"
#include "acc/util/json_fields.hpp"
#include "acc/util/logging.hpp"
#include "acc/util/system.hpp"
#include "acc/util/timer.hpp"
#include "measure.hpp"

#ifndef ACC_VERSION
#error "ACC_VERSION (the project's version) must be defined by the build"
#endif

namespace acc::search {

using json::brief;
using json::Fields;

// ---- fingerprint ----

namespace {

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

// The value of the first "<key>\t: value" line of /proc/cpuinfo, "" when there is none.
std::string cpuinfo_field(const std::string& cpuinfo, const std::string& key) {
  std::istringstream in(cpuinfo);
  std::string line;
  while (std::getline(in, line)) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    if (trim(line.substr(0, colon)) == key) return trim(line.substr(colon + 1));
  }
  return "";
}

const char* const kFingerprintFields[] = {
    "autoacc_version", "blas_config", "blas_core", "build",
    "cores",           "cpu_model",   "isa",       "memory_gib"};

// HardwareFingerprint::build of this library. gcc names a sanitizer by a macro; clang says it
// by __has_feature too.
#if defined(__has_feature)
#define ACC_HAS_FEATURE(x) __has_feature(x)
#else
#define ACC_HAS_FEATURE(x) 0
#endif
std::string build_flavour() {
#if defined(__OPTIMIZE__)
  std::string b = "optimized";
#else
  std::string b = "unoptimized";
#endif
#if defined(__SANITIZE_ADDRESS__) || ACC_HAS_FEATURE(address_sanitizer)
  b += "+asan";
#endif
#if defined(__SANITIZE_THREAD__) || ACC_HAS_FEATURE(thread_sanitizer)
  b += "+tsan";
#endif
  return b;
}
#undef ACC_HAS_FEATURE

}  // namespace

HardwareFingerprint hardware_fingerprint() {
  HardwareFingerprint f;
  std::ifstream in("/proc/cpuinfo");
  std::stringstream text;
  text << in.rdbuf();
  const std::string cpuinfo = text.str();
  f.cpu_model = cpuinfo_field(cpuinfo, "model name");
  if (f.cpu_model.empty()) f.cpu_model = "unknown";
  std::set<std::string> flags;
  std::istringstream words(cpuinfo_field(cpuinfo, "flags"));
  for (std::string w; words >> w;) flags.insert(w);
  for (const char* isa : HardwareFingerprint::kIsaFlags) {
    const bool has = std::string(isa) == "amx" ? flags.count("amx_tile") > 0 : flags.count(isa) > 0;
    if (has) f.isa.push_back(isa);
  }
  f.cores = usable_cores();
  constexpr int64_t kGiB = int64_t{1} << 30;
  f.memory_gib = (physical_memory_bytes() + kGiB / 2) / kGiB;
  const char* core = openblas_get_corename();
  const char* config = openblas_get_config();
  f.blas_core = trim(core ? core : "");
  f.blas_config = trim(config ? config : "");
  f.autoacc_version = ACC_VERSION;
  f.build = build_flavour();
  return f;
}

nlohmann::json HardwareFingerprint::to_json() const {
  return {{"cpu_model", cpu_model},
          {"isa", isa},
          {"cores", cores},
          {"memory_gib", memory_gib},
          {"blas_core", blas_core},
          {"blas_config", blas_config},
          {"autoacc_version", autoacc_version},
          {"build", build}};
}

namespace {

// `path` is where the fingerprint sits in the document ("" at its root, "hardware" in a cache).
HardwareFingerprint fingerprint_from_json(const nlohmann::json& j, const std::string& what,
                                          const std::string& path) {
  Fields f(j, what, path);
  HardwareFingerprint h;
  h.cpu_model = f.string("cpu_model");
  const nlohmann::json& isa = f.at("isa");
  if (!isa.is_array()) f.fail(f.path("isa"), "must be a list of strings, got " + brief(isa));
  for (size_t i = 0; i < isa.size(); ++i) {
    if (!isa[i].is_string()) {
      f.fail(f.path("isa") + "[" + std::to_string(i) + "]",
             "must be a string, got " + brief(isa[i]));
    }
    h.isa.push_back(isa[i].get<std::string>());
  }
  h.cores = static_cast<int>(f.integer("cores", 1, 1 << 20));
  h.memory_gib = f.integer("memory_gib", 0, int64_t{1} << 40);
  h.blas_core = f.string("blas_core");
  h.blas_config = f.string("blas_config");
  h.autoacc_version = f.string("autoacc_version");
  // Absent from the files of the builds before it: "" (another build than any this one names).
  if (f.optional("build")) h.build = f.string("build");
  f.no_others();
  return h;
}

}  // namespace

HardwareFingerprint HardwareFingerprint::from_json(const nlohmann::json& j) {
  return fingerprint_from_json(j, "hardware fingerprint", "");
}

std::string HardwareFingerprint::key() const {
  // nlohmann's objects keep their keys sorted, so the text is canonical.
  return fnv1a64_hex(to_json().dump());
}

std::string HardwareFingerprint::difference(const HardwareFingerprint& other) const {
  const nlohmann::json a = to_json(), b = other.to_json();
  for (const char* field : kFingerprintFields) {
    if (a.at(field) != b.at(field)) {
      return ::acc::detail::str_cat(field, ": ", a.at(field).dump(), " vs ", b.at(field).dump());
    }
  }
  return "";
}

// ---- GEMM shapes ----

int64_t GemmShape::flops() const {
  // The shape itself is passed, not str(): checked_mul formats it only when the product overflows
  // (the cost model asks this of every GEMM of every trace it prices).
  return checked_mul(
      checked_mul(checked_mul(int64_t{2}, m, "FLOPs of GEMM ", *this), n, "FLOPs of GEMM ", *this),
      k, "FLOPs of GEMM ", *this);
}

std::string GemmShape::str() const {
  return ::acc::detail::str_cat(m, "x", n, "x", k, " ", trans_a ? "T" : "N", trans_b ? "T" : "N");
}

// ---- MachineCalibration ----

namespace {

void check_dims(int64_t m, int64_t n, int64_t k) {
  ACC_CHECK(m >= 0 && n >= 0 && k >= 0, "gemm_seconds: dimensions must be >= 0, got m=", m,
            " n=", n, " k=", k);
}

}  // namespace

double MachineCalibration::gemm_seconds(const GemmShape& s) const {
  check_dims(s.m, s.n, s.k);
  if (s.m == 0 || s.n == 0 || s.k == 0) return 0;
  ACC_CHECK(!gemm_gflops.empty(), "gemm_seconds(", s.str(), "): no GEMM shape was measured");
  const double flops = static_cast<double>(s.flops());
  auto exact = gemm_gflops.find(s);
  if (exact != gemm_gflops.end()) return flops / (exact->second * 1e9);
  const double lm = std::log(static_cast<double>(s.m)), ln = std::log(static_cast<double>(s.n)),
               lk = std::log(static_cast<double>(s.k));
  double best_gflops = 0;
  std::tuple<double, double, bool> best{INFINITY, INFINITY, true};
  for (const auto& [shape, gflops] : gemm_gflops) {
    const double sm = std::log(static_cast<double>(shape.m)),
                 sn = std::log(static_cast<double>(shape.n)),
                 sk = std::log(static_cast<double>(shape.k));
    const std::tuple<double, double, bool> d{
        std::abs((lm + ln + lk) - (sm + sn + sk)),
        std::abs(lm - sm) + std::abs(ln - sn) + std::abs(lk - sk),
        shape.trans_a != s.trans_a || shape.trans_b != s.trans_b};
    if (d < best) {
      best = d;
      best_gflops = gflops;
    }
  }
  return flops / (best_gflops * 1e9);
}

double MachineCalibration::gemm_seconds(int64_t m, int64_t n, int64_t k) const {
  return gemm_seconds(GemmShape{m, n, k});
}

double MachineCalibration::memory_seconds(int64_t bytes) const {
  ACC_CHECK(bytes >= 0, "memory_seconds: bytes must be >= 0, got ", bytes);
  ACC_CHECK(memory_gbps > 0 && std::isfinite(memory_gbps),
            "memory_seconds: no memory bandwidth measured (memory_gbps = ", memory_gbps, ")");
  return static_cast<double>(bytes) / (memory_gbps * 1e9);
}

nlohmann::json MachineCalibration::to_json() const {
  nlohmann::json gemm = nlohmann::json::array();
  for (const auto& [s, gflops] : gemm_gflops) {
    gemm.push_back({{"m", s.m},
                    {"n", s.n},
                    {"k", s.k},
                    {"trans_a", s.trans_a},
                    {"trans_b", s.trans_b},
                    {"gflops", gflops}});
  }
  nlohmann::json j = {{"hardware", hardware.to_json()},   {"threads", threads},
                      {"gemm_threading", gemm_threading}, {"gemm_operands", gemm_operands},
                      {"memory_gbps", memory_gbps},       {"gemm", gemm}};
  if (op_overhead_s > 0) j["op_overhead_us"] = op_overhead_s * 1e6;
  if (!contention.empty()) {
    j["contention"] = nlohmann::json::array();
    for (const auto& [ranks, factor] : contention) {
      j["contention"].push_back({{"local_ranks", ranks}, {"factor", factor}});
    }
  }
  return j;
}

namespace {

MachineCalibration machine_from_json(const nlohmann::json& j, const std::string& what) {
  Fields f(j, what);
  MachineCalibration c;
  c.hardware = fingerprint_from_json(f.at("hardware"), what, "hardware");
  c.threads = static_cast<int>(f.integer("threads", 1, 1024));
  c.gemm_threading = f.string("gemm_threading");
  if (c.gemm_threading != "openblas" && c.gemm_threading != "tbb") {
    f.fail("gemm_threading", "must be \"openblas\" or \"tbb\", got \"" + c.gemm_threading + "\"");
  }
  // A file written before the field measured the same operands at every call.
  c.gemm_operands = f.optional("gemm_operands") ? f.string("gemm_operands") : "hot";
  if (c.gemm_operands != "hot" && c.gemm_operands != "cold") {
    f.fail("gemm_operands", "must be \"hot\" or \"cold\", got \"" + c.gemm_operands + "\"");
  }
  c.memory_gbps = f.number("memory_gbps", 0, true);
  const nlohmann::json& gemm = f.at("gemm");
  if (!gemm.is_array()) f.fail("gemm", "must be a list, got " + brief(gemm));
  for (size_t i = 0; i < gemm.size(); ++i) {
    Fields g(gemm[i], what, "gemm[" + std::to_string(i) + "]");
    constexpr int64_t kMaxDim = int64_t{1} << 40;
    GemmShape s{g.integer("m", 1, kMaxDim), g.integer("n", 1, kMaxDim), g.integer("k", 1, kMaxDim),
                g.boolean("trans_a"), g.boolean("trans_b")};
    const double gflops = g.number("gflops", 0, true);
    g.no_others();
    try {
      s.flops();
    } catch (const ValueError&) {
      g.fail("gemm[" + std::to_string(i) + "]", "has FLOPs that overflow 64 bits: " + s.str());
    }
    if (!c.gemm_gflops.emplace(s, gflops).second) {
      g.fail("gemm[" + std::to_string(i) + "]", "repeats the shape " + s.str());
    }
  }
  if (f.optional("op_overhead_us")) c.op_overhead_s = f.number("op_overhead_us", 0, true) * 1e-6;
  if (const nlohmann::json* list = f.optional("contention")) {
    if (!list->is_array()) f.fail("contention", "must be a list, got " + brief(*list));
    for (size_t i = 0; i < list->size(); ++i) {
      const std::string at = "contention[" + std::to_string(i) + "]";
      Fields e((*list)[i], what, at);
      const int ranks = static_cast<int>(e.integer("local_ranks", 2, 1 << 20));
      const double factor = e.number("factor", 1.0, false);
      e.no_others();
      if (!c.contention.emplace(ranks, factor).second) {
        e.fail(at, "repeats local_ranks " + std::to_string(ranks));
      }
    }
  }
  f.no_others();
  return c;
}

}  // namespace

MachineCalibration MachineCalibration::from_json(const nlohmann::json& j) {
  return machine_from_json(j, "machine calibration");
}

// ---- measuring ----

namespace {

const char* threading_name(GemmThreading g) {
  return g == GemmThreading::kTbb ? "tbb" : "openblas";
}

void check_options(const CalibrationOptions& o) {
  ACC_CHECK(o.threads >= 1 && o.threads <= 1024, "calibration: threads must be in [1, 1024], got ",
            o.threads);
  ACC_CHECK(std::isfinite(o.seconds_per_point) && o.seconds_per_point > 0,
            "calibration: seconds_per_point must be a positive finite number, got ",
            o.seconds_per_point);
}

void check_shapes(const std::vector<GemmShape>& shapes) {
  for (const GemmShape& s : shapes) {
    ACC_CHECK(s.m >= 1 && s.n >= 1 && s.k >= 1, "calibration: GEMM dimensions must be >= 1, got ",
              s.str());
    s.flops();  // refuses a shape whose FLOPs overflow
  }
}

// Sets the thread count for the measurement and restores the caller's.
class ThreadsGuard {
 public:
  explicit ThreadsGuard(int n) : previous_(get_num_threads()) {
    if (n != previous_) set_num_threads(n);
  }
  ~ThreadsGuard() {
    if (get_num_threads() != previous_) set_num_threads(previous_);
  }
  ThreadsGuard(const ThreadsGuard&) = delete;
  ThreadsGuard& operator=(const ThreadsGuard&) = delete;

 private:
  int previous_;
};

Tensor filled(int64_t n, Generator& gen) {
  Tensor t = empty({n}, TensorOptions{.device = Device::kCPU});
  uniform_(t, -1.0, 1.0, gen);
  return t;
}

// Random operands of one GEMM shape and the call that runs it, as the engine's linears do, each
// call on the next of several copies of the operands spanning kColdOperandBytes ("cold", see
// MachineCalibration::gemm_operands): a step's GEMM finds its weights where the rest of the step
// left them, not in the core's caches.
class GemmRun {
 public:
  GemmRun(const GemmShape& s, Generator& gen) : s_(s) {
    const int64_t a = checked_mul(s.m, s.k, "calibration: A of ", s.str());
    const int64_t b = checked_mul(s.k, s.n, "calibration: B of ", s.str());
    const int64_t c = checked_mul(s.m, s.n, "calibration: C of ", s.str());
    const int64_t set_bytes =
        checked_mul(checked_add(checked_add(a, b, "calibration: operands of ", s.str()), c,
                                "calibration: operands of ", s.str()),
                    4, "calibration: operand bytes of ", s.str());
    // Rounded up: a set of 9 MiB gets two copies, not one.
    const int64_t copies =
        std::clamp<int64_t>((kColdOperandBytes + set_bytes - 1) / std::max<int64_t>(1, set_bytes),
                            1, kMaxOperandCopies);
    // C zeroed, not empty: every copy's pages are touched before the timed calls.
    const TensorOptions cpu{.device = Device::kCPU};
    sets_.push_back({filled(a, gen), filled(b, gen), zeros({c}, cpu)});
    for (int64_t i = 1; i < copies; ++i) {
      sets_.push_back({sets_[0].a.clone(), sets_[0].b.clone(), zeros({c}, cpu)});
    }
  }
  void operator()() {
    Operands& o = sets_[next_];
    next_ = (next_ + 1) % sets_.size();
    kernels::gemm(s_.trans_a, s_.trans_b, s_.m, s_.n, s_.k, 1.f, o.a.data<float>(),
                  s_.trans_a ? s_.m : s_.k, o.b.data<float>(), s_.trans_b ? s_.k : s_.n, 0.f,
                  o.c.data<float>(), s_.n);
  }

 private:
  struct Operands {
    Tensor a, b, c;
  };
  // The copies span 16 MiB, or 4096 copies of a tiny shape. Measured on the 2-vCPU VM (AMD EPYC,
  // 2026-11-29) for the 15 GEMMs of a GPT block of width 128 at 64 tokens: 871 us the same
  // operands every call, 900 us over 4 MiB, 1038 us over 16 MiB, 1069 us over 64 MiB; in the
  // training step (perf: the GEMMs' share of a micro-batch) they took about 30 % more than with
  // the same operands, which had the time model 25 % under the step at one sample a micro-batch.
  static constexpr int64_t kColdOperandBytes = int64_t{16} << 20;
  static constexpr int64_t kMaxOperandCopies = 4096;
  GemmShape s_;
  std::vector<Operands> sets_;
  size_t next_ = 0;
};

double measure_gemm(const GemmShape& s, double seconds_per_point, Generator& gen) {
  GemmRun run(s, gen);
  const double seconds = detail::median_seconds(run, seconds_per_point);
  return static_cast<double>(s.flops()) / seconds / 1e9;
}

// The last-level cache of CPU 0 in bytes (32 MiB when sysfs does not say).
int64_t last_level_cache_bytes() {
  int64_t best = 0;
  for (int i = 0; i < 8; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i);
    std::ifstream size_file(dir + "/size");
    std::string size;
    if (!(size_file >> size) || size.empty()) continue;
    int64_t mult = 1;
    if (size.back() == 'K') mult = 1 << 10;
    if (size.back() == 'M') mult = 1 << 20;
    try {
      best = std::max<int64_t>(best, std::stoll(size) * mult);
    } catch (const std::exception&) {
      continue;
    }
  }
  return best > 0 ? best : int64_t{32} << 20;
}

double measure_memory(double seconds_per_point) {
  // Three arrays of twice the last-level cache each (at least 32 MiB, at most 256 MiB): nothing of
  // one call is left in cache for the next.
  const int64_t array_bytes =
      std::clamp<int64_t>(2 * last_level_cache_bytes(), int64_t{32} << 20, int64_t{256} << 20);
  const int64_t n = array_bytes / 4;
  const TensorOptions cpu{.device = Device::kCPU};
  const Tensor a = full({n}, 0.5, cpu), b = full({n}, 0.25, cpu);
  // The residual adds and gradient accumulation of the engine: out = a + b, out allocated per
  // call through the caching allocator as there (the block of the call before is reused).
  const double seconds = detail::median_seconds(
      [&] { (void)kernels::binary(kernels::BinaryOp::kAdd, a, b); }, seconds_per_point);
  return 3.0 * static_cast<double>(array_bytes) / seconds / 1e9;
}

double measure_op_overhead(double seconds_per_point) {
  // A chain of scalar multiplications over 8 elements, forward and backward: its work is nothing,
  // its time what every op costs the engine (dispatch, allocation, the autograd node and running
  // it). Ops executed: the chain's forwards and backward nodes, the sum's two, the accumulation.
  // The fastest of three rounds' medians (as a collective's point is): the figure is cached for
  // every later search, and a neighbour's burst during one round must not price every op of them.
  constexpr int kChain = 32;
  constexpr int kRounds = 3;
  Tensor leaf = full({8}, 1.0, {.device = Device::kCPU});
  leaf.set_requires_grad(true);
  double seconds = std::numeric_limits<double>::infinity();
  for (int round = 0; round < kRounds; ++round) {
    seconds = std::min(seconds, detail::median_seconds(
                                    [&] {
                                      Tensor y = leaf;
                                      for (int i = 0; i < kChain; ++i) y = y * 1.0001;
                                      sum(y).backward();
                                      leaf.set_grad(Tensor());
                                    },
                                    seconds_per_point / kRounds));
  }
  return seconds / (2.0 * kChain + 3.0);
}

std::vector<GemmShape> distinct(std::vector<GemmShape> shapes) {
  std::sort(shapes.begin(), shapes.end());
  shapes.erase(std::unique(shapes.begin(), shapes.end()), shapes.end());
  return shapes;
}

// The shape timed for `s`: itself up to kMaxTimedGemmFlops, else `s` with its largest dimensions
// halved (none below 512) until it is under: a GEMM that large runs at the kernel's saturated rate,
// which the smaller one shows in milliseconds instead of seconds (a 175B model's head is a
// 2048 x 50257 x 12288 product, 2.5 TFLOP: half a minute a call on one core).
constexpr int64_t kMaxTimedGemmFlops = int64_t{4} << 30;

GemmShape timed_shape(GemmShape s) {
  while (s.flops() > kMaxTimedGemmFlops) {
    int64_t* largest = &s.m;
    for (int64_t* d : {&s.n, &s.k}) {
      if (*d > *largest) largest = d;
    }
    if (*largest < 1024) break;
    *largest /= 2;
  }
  return s;
}

// Measures `shapes` (and the memory bandwidth when `memory`) into `c`.
void measure_into(MachineCalibration& c, const std::vector<GemmShape>& shapes, bool memory,
                  const CalibrationOptions& o) {
  ThreadsGuard threads(o.threads);
  // A private stream: the caller's default generator (and so its training) is left as it was.
  Generator gen(0x6361'6c69'6272'6174ull);
  for (const GemmShape& s : shapes) {
    const double gflops = measure_gemm(timed_shape(s), o.seconds_per_point, gen);
    c.gemm_gflops[s] = gflops;
    logging::debug("calibration: gemm {} {:.2f} GFLOP/s ({} threads)", s.str(), gflops, o.threads);
  }
  c.source.gemm_measured = static_cast<int>(shapes.size());
  if (memory) {
    c.memory_gbps = measure_memory(o.seconds_per_point);
    logging::debug("calibration: memory {:.2f} GB/s ({} threads)", c.memory_gbps, o.threads);
  }
  if (memory || c.op_overhead_s <= 0) {
    c.op_overhead_s = measure_op_overhead(o.seconds_per_point);
    logging::debug("calibration: {:.2f} us an op ({} threads)", c.op_overhead_s * 1e6, o.threads);
  }
}

MachineCalibration fresh(const CalibrationOptions& o) {
  MachineCalibration c;
  c.hardware = hardware_fingerprint();
  c.threads = o.threads;
  c.gemm_threading = threading_name(gemm_threading());
  return c;
}

}  // namespace

MachineCalibration calibrate_machine(const std::vector<GemmShape>& shapes,
                                     const CalibrationOptions& options) {
  check_options(options);
  check_shapes(shapes);
  Timer timer;
  MachineCalibration c = fresh(options);
  measure_into(c, distinct(shapes), /*memory=*/true, options);
  c.source.seconds = timer.elapsed_s();
  return c;
}

// ---- the cache ----

std::string default_cache_dir() {
  if (auto dir = env::get("ACC_CACHE_DIR")) return *dir;
  if (auto xdg = env::get("XDG_CACHE_HOME")) return *xdg + "/autoacc";
  if (auto home = env::get("HOME")) return *home + "/.cache/autoacc";
  ACC_THROW(ValueError,
            "no cache directory: set ACC_CACHE_DIR (or XDG_CACHE_HOME or HOME), or pass "
            "CalibrationOptions::cache_dir");
}

std::string machine_cache_path(const CalibrationOptions& options) {
  check_options(options);
  const std::string dir = options.cache_dir.empty() ? default_cache_dir() : options.cache_dir;
  return (std::filesystem::path(dir) / ("machine-" + hardware_fingerprint().key() + "-t" +
                                        std::to_string(options.threads) + ".json"))
      .string();
}

namespace {

// The figures are good without the file: a cache that cannot be written (a read-only home on a
// cluster) costs the next run its calibration time, not this run its search.
void save_machine(MachineCalibration& c, const std::string& path) {
  try {
    const auto dir = std::filesystem::path(path).parent_path();
    std::error_code ec;
    if (!dir.empty()) std::filesystem::create_directories(dir, ec);
    ACC_CHECK_AS(IoError, !ec, "machine calibration cache: cannot create the directory '",
                 dir.string(), "': ", ec.message());
    write_text_file_atomically(path, c.to_json().dump(2) + "\n", "machine calibration cache");
  } catch (const IoError& e) {
    c.source.note += (c.source.note.empty() ? "" : "; ") + std::string("not saved: ") + e.what();
    logging::warn("calibration: {}", e.what());
  }
}

}  // namespace

MachineCalibration load_or_calibrate_machine(const std::vector<GemmShape>& shapes,
                                             const CalibrationOptions& options) {
  check_options(options);
  check_shapes(shapes);
  Timer timer;
  const std::string path = machine_cache_path(options);
  const std::vector<GemmShape> wanted = distinct(shapes);
  MachineCalibration c = fresh(options);
  bool usable = false;
  std::string note;
  if (std::filesystem::exists(path)) {
    const std::string what = "machine calibration cache '" + path + "'";
    const nlohmann::json j = read_json_file(path, "machine calibration cache");
    // The fingerprint first: a file of another machine or another AutoAcc version is replaced
    // even when the rest is in a form this build does not read.
    Fields top(j, what);
    const HardwareFingerprint cached = fingerprint_from_json(top.at("hardware"), what, "hardware");
    if (cached != c.hardware) {
      note = "is of another machine (" + c.hardware.difference(cached) + " in the cache)";
    } else {
      MachineCalibration read = machine_from_json(j, what);
      if (read.threads != options.threads) {
        top.fail("threads", ::acc::detail::str_cat("is ", read.threads, " in a file named for ",
                                                   options.threads, " threads"));
      }
      if (read.gemm_threading != c.gemm_threading) {
        note = "was measured with gemm threading " + read.gemm_threading + ", this process uses " +
               c.gemm_threading;
      } else if (read.gemm_operands != c.gemm_operands) {
        note = "timed its GEMMs on " + read.gemm_operands + " operands, this build on " +
               c.gemm_operands + " ones";
      } else {
        c.gemm_gflops = std::move(read.gemm_gflops);
        c.memory_gbps = read.memory_gbps;
        c.op_overhead_s = read.op_overhead_s;
        c.contention = std::move(read.contention);
        usable = true;
      }
    }
    if (!usable) logging::info("calibration: cache '{}' {}: measuring again", path, note);
  }
  std::vector<GemmShape> missing;
  for (const GemmShape& s : wanted) {
    if (c.gemm_gflops.count(s)) {
      ++c.source.gemm_from_cache;
    } else {
      missing.push_back(s);
    }
  }
  c.source.memory_from_cache = usable;
  c.source.cache_file = path;
  c.source.note = note;
  if (!missing.empty() || !usable || c.op_overhead_s <= 0) {
    measure_into(c, missing, /*memory=*/!usable, options);
    save_machine(c, path);
  }
  c.source.seconds = timer.elapsed_s();
  logging::info(
      "calibration: {} GEMM shapes from '{}', {} measured{}, memory {:.2f} GB/s{} in {:.2f} s",
      c.source.gemm_from_cache, path, c.source.gemm_measured, usable ? "" : " (no usable cache)",
      c.memory_gbps, usable ? " (cached)" : "", c.source.seconds);
  return c;
}

// ---- sharing ----

double measure_compute_contention(dist::ProcessGroup& group, const std::vector<GemmShape>& shapes,
                                  double seconds_per_point) {
  ACC_CHECK(std::isfinite(seconds_per_point) && seconds_per_point > 0,
            "measure_compute_contention: seconds_per_point must be a positive finite number, got ",
            seconds_per_point);
  if (group.size() == 1) return 1.0;
  GemmShape s{256, 256, 256, false, false};
  if (!shapes.empty()) {
    s = *std::max_element(shapes.begin(), shapes.end(), [](const GemmShape& l, const GemmShape& r) {
      return l.flops() < r.flops();
    });
  }
  Generator gen(4321);
  GemmRun gemm(s, gen);
  // 8 MiB arrays: past a core's private caches, so the ranks compete for the shared cache and the
  // memory bus, yet a call takes about a millisecond (the calibration's LLC-sized arrays take 30).
  const int64_t n = int64_t{2} << 20;
  const Tensor x = full({n}, 0.5, TensorOptions{.device = Device::kCPU});
  const Tensor y = full({n}, 0.25, TensorOptions{.device = Device::kCPU});
  auto unit = [&] {
    gemm();
    (void)kernels::binary(kernels::BinaryOp::kAdd, x, y);
  };
  // The same number of calls alone (rank 0, the others waiting) and together, each timed whole:
  // a median per call would pick the calls that ran within one time slice and miss the sharing it
  // is here to see.
  unit();  // warm: caches, page mappings, the BLAS's buffers
  Timer first;
  unit();
  const int64_t calls = std::clamp<int64_t>(
      static_cast<int64_t>(seconds_per_point / std::max(first.elapsed_s(), 1e-6)), 3, 100000);
  Tensor counts = from_vector(std::vector<int64_t>{calls}, {1});
  group.broadcast(counts, 0)->wait();
  const int64_t n_calls = counts.to_vector<int64_t>()[0];
  auto timed = [&] {
    Timer t;
    for (int64_t i = 0; i < n_calls; ++i) unit();
    return static_cast<float>(t.elapsed_s() / static_cast<double>(n_calls));
  };
  Tensor alone = zeros({1}, TensorOptions{.device = Device::kCPU});
  group.barrier()->wait();
  if (group.rank() == 0) alone.data<float>()[0] = timed();
  group.broadcast(alone, 0)->wait();
  Tensor together = zeros({1}, TensorOptions{.device = Device::kCPU});
  group.barrier()->wait();
  together.data<float>()[0] = timed();
  group.allreduce(together, dist::ReduceOp::kMax)->wait();
  return std::max(1.0, static_cast<double>(together.data<float>()[0]) /
                           static_cast<double>(alone.data<float>()[0]));
}

double measure_collective_wait(dist::ProcessGroup& group, int group_size, const GemmShape& shape,
                               int64_t calls, const CommCalibration& fit, int64_t bytes,
                               int stride) {
  ACC_CHECK(group_size >= 1 && group.size() % group_size == 0,
            "measure_collective_wait: group size ", group_size, " does not divide the ",
            group.size(), " ranks of '", group.name(), "'");
  ACC_CHECK(stride >= 1 && group.size() % (group_size * stride) == 0,
            "measure_collective_wait: groups of ", group_size, " ranks ", stride,
            " apart do not tile the ", group.size(), " ranks of '", group.name(), "'");
  ACC_CHECK(calls >= 1, "measure_collective_wait: calls must be >= 1, got ", calls);
  ACC_CHECK(bytes >= 4, "measure_collective_wait: bytes must be >= 4 (one f32), got ", bytes);
  if (group.size() == 1 || group_size == 1) return 0.0;
  const int rank = group.rank();
  // Rank r's group: the group_size ranks stride apart from the first of its block of
  // group_size x stride (a mesh dimension's group: tp's contiguous, an outer one's strided).
  const int block = group_size * stride;
  const dist::ProcessGroupPtr mine =
      group.split((rank / block) * stride + rank % stride, (rank % block) / stride,
                  "wait of " + std::to_string(group_size) + " stride " + std::to_string(stride));
  Generator gen(4321);
  GemmRun gemm(shape, gen);
  Tensor small = zeros({bytes / 4}, TensorOptions{.device = Device::kCPU});
  gemm();  // warm: caches, page mappings, the BLAS's buffers
  // One pass, all ranks at once, timed whole (a median per call would keep the calls that ran
  // within one time slice): the slowest rank's seconds per call.
  auto pass = [&](bool communicate) {
    group.barrier()->wait();
    Timer t;
    for (int64_t i = 0; i < calls; ++i) {
      gemm();
      if (communicate) mine->allreduce(small, dist::ReduceOp::kSum)->wait();
    }
    Tensor took = from_vector(std::vector<float>{static_cast<float>(t.elapsed_s())}, {1});
    group.allreduce(took, dist::ReduceOp::kMax)->wait();
    return static_cast<double>(took.data<float>()[0]) / static_cast<double>(calls);
  };
  const double own = fit.ops.count("allreduce") ? fit.seconds("allreduce", bytes / 4 * 4) : 0.0;
  std::vector<double> waits;
  for (int round = 0; round < 3; ++round) {
    const double alone = pass(false);
    waits.push_back(pass(true) - alone - own);
  }
  std::sort(waits.begin(), waits.end());
  return std::max(0.0, waits[1]);
}

CommCalibration calibrate_contiguous_groups(dist::ProcessGroup& world, int size) {
  ACC_CHECK(size >= 1 && world.size() % size == 0, "calibrate_contiguous_groups: groups of ", size,
            " do not divide the ", world.size(), " ranks of '", world.name(), "'");
  const int rank = world.rank();
  const dist::ProcessGroupPtr g =
      world.split(rank / size, rank % size, "calibration of " + std::to_string(size));
  const CommCalibration mine = calibrate_collectives_for_search(*g);
  return CommCalibration::from_json(
      nlohmann::json::parse(dist::broadcast_text(world, mine.to_json().dump())));
}

WaitProbe collective_wait_probe(const std::vector<GemmShape>& shapes,
                                const MachineCalibration& machine) {
  ACC_CHECK(!shapes.empty(), "collective_wait_probe: no GEMM shapes given");
  std::vector<GemmShape> by_flops = shapes;
  std::sort(by_flops.begin(), by_flops.end(),
            [](const auto& a, const auto& b) { return a.flops() < b.flops(); });
  WaitProbe p;
  p.shape = by_flops[by_flops.size() / 2];
  p.calls = static_cast<int64_t>(
      std::clamp(0.02 / std::max(machine.gemm_seconds(p.shape), 1e-7), 16.0, 256.0));
  p.bulk_calls = std::min<int64_t>(p.calls, 24);
  p.long_shape = by_flops.back();
  p.long_calls = static_cast<int64_t>(
      std::clamp(0.02 / std::max(machine.gemm_seconds(p.long_shape), 1e-7), 8.0, 256.0));
  return p;
}

JobCores job_cores(dist::ProcessGroup& group, int threads) {
  // A node's ranks over the union of their affinity masks, not over this rank's own: bound to a
  // core each (mpirun --bind-to core), 4 ranks on 2 cores see 1 core apiece, and "4 ranks x 1
  // thread / 1 core" priced every compute 4x slower than alone where it runs about 2.3x.
  const dist::NodeCores node = dist::node_cores(group);
  const double share =
      static_cast<double>(node.ranks) * std::max(1, threads) / static_cast<double>(node.cores);
  // The busiest node's figures: ranks in whole ranks, the share in millionths (one integer
  // all-reduce for both).
  Tensor mine = from_vector(
      std::vector<int64_t>{node.ranks, static_cast<int64_t>(std::llround(share * 1e6))}, {2});
  group.allreduce(mine, dist::ReduceOp::kMax)->wait();
  const std::vector<int64_t> most = mine.to_vector<int64_t>();
  JobCores out;
  out.local_ranks = static_cast<int>(most[0]);
  out.share = static_cast<double>(most[1]) / 1e6;  // exact for halves and quarters
  return out;
}

double contention_for_job(dist::ProcessGroup& group, MachineCalibration& machine,
                          const std::vector<GemmShape>& shapes, const CalibrationOptions& options,
                          bool* from_cache, JobCores* cores_out) {
  if (from_cache) *from_cache = false;
  if (cores_out) *cores_out = JobCores{};
  if (group.size() == 1) return 1.0;
  const JobCores cores = job_cores(group, options.threads);
  if (cores_out) *cores_out = cores;
  const int ranks = cores.local_ranks;
  if (ranks < 2) return measure_compute_contention(group, shapes);  // one rank per machine
  // More ranks x threads than usable cores time-slice: each rank computes at most cores /
  // (ranks x threads) of the time, whatever one measurement saw (4 ranks on these 2 vCPUs
  // measured 1.69, 2.46 and 3.27 in three runs; time slicing alone makes 2).
  const double sliced = cores.share;
  if (auto it = machine.contention.find(ranks); it != machine.contention.end()) {
    if (from_cache) *from_cache = true;
    return std::max(it->second, sliced);
  }
  const double factor = measure_compute_contention(group, shapes);
  machine.contention[ranks] = factor;
  if (group.rank() == 0) save_machine(machine, machine_cache_path(options));
  return std::max(factor, sliced);
}

MachineCalibration broadcast_calibration(dist::ProcessGroup& group,
                                         const MachineCalibration& calibration, int root) {
  ACC_CHECK(root >= 0 && root < group.size(), "broadcast_calibration: root ", root,
            " is not a rank of group '", group.name(), "' of ", group.size());
  if (group.size() == 1) return calibration;
  std::string text;
  if (group.rank() == root) {
    const CalibrationSource& s = calibration.source;
    text = nlohmann::json{{"calibration", calibration.to_json()},
                          {"source",
                           {{"gemm_from_cache", s.gemm_from_cache},
                            {"gemm_measured", s.gemm_measured},
                            {"memory_from_cache", s.memory_from_cache},
                            {"seconds", s.seconds},
                            {"cache_file", s.cache_file},
                            {"note", s.note}}}}
               .dump();
  }
  // Every rank, root included, reads the text back: a calibration that does not read is then the
  // same error on every rank instead of one on the others only.
  text = dist::broadcast_text(group, text, root);
  const nlohmann::json j = nlohmann::json::parse(text);
  MachineCalibration c = MachineCalibration::from_json(j.at("calibration"));
  const nlohmann::json& s = j.at("source");
  c.source.gemm_from_cache = s.at("gemm_from_cache").get<int>();
  c.source.gemm_measured = s.at("gemm_measured").get<int>();
  c.source.memory_from_cache = s.at("memory_from_cache").get<bool>();
  c.source.seconds = s.at("seconds").get<double>();
  c.source.cache_file = s.at("cache_file").get<std::string>();
  c.source.note = s.at("note").get<std::string>();
  return c;
}

}  // namespace acc::search
