// Alpha-beta fits of the collectives, measured on the job's own process groups.

#include <algorithm>
#include <cmath>

#include "acc/search/calibration.hpp"
#include "acc/util/error.hpp"
#include "acc/util/json_fields.hpp"
#include "acc/util/logging.hpp"
#include "acc/util/timer.hpp"

namespace acc::search {
namespace {

// The collectives measured: each issues its op on `whole` (the full tensor) and `block` (this
// rank's 1/world of it).
struct Collective {
  const char* name;
  dist::WorkPtr (*issue)(dist::ProcessGroup& g, Tensor& whole, Tensor& block);
};
const Collective kCollectives[] = {
    {"allreduce", [](dist::ProcessGroup& g, Tensor& whole,
                     Tensor&) { return g.allreduce(whole, dist::ReduceOp::kSum); }},
    {"reduce_scatter",
     [](dist::ProcessGroup& g, Tensor& whole, Tensor& block) {
       return g.reduce_scatter(block, whole, dist::ReduceOp::kSum);
     }},
    {"allgather",
     [](dist::ProcessGroup& g, Tensor& whole, Tensor& block) { return g.allgather(whole, block); }},
    {"broadcast",
     [](dist::ProcessGroup& g, Tensor& whole, Tensor&) { return g.broadcast(whole, 0); }},
};

std::string known_ops() {
  std::string s;
  for (const Collective& c : kCollectives) s += (s.empty() ? "" : ", ") + std::string(c.name);
  return s;
}

bool is_op(const std::string& op) {
  return std::any_of(std::begin(kCollectives), std::end(kCollectives),
                     [&](const Collective& c) { return op == c.name; });
}

}  // namespace

AlphaBeta fit_alpha_beta(const std::vector<CommPoint>& points) {
  double s0 = 0, s1 = 0, s2 = 0, t0 = 0, t1 = 0;
  for (const CommPoint& p : points) {
    const double t = std::max(p.seconds, 1e-9), b = static_cast<double>(p.bytes);
    const double w = 1.0 / t;
    s0 += w;
    s1 += w * b;
    s2 += w * b * b;
    t0 += w * t;
    t1 += w * b * t;
  }
  AlphaBeta ab;
  if (points.empty()) return ab;
  const double det = s0 * s2 - s1 * s1;
  // One size (det 0) says nothing about latency: all of it is put on bandwidth.
  if (det > 1e-12 * s0 * s2) {
    ab.beta_s_per_byte = (s0 * t1 - s1 * t0) / det;
    ab.alpha_s = (t0 - ab.beta_s_per_byte * s1) / s0;
  } else {
    ab.alpha_s = -1;
  }
  if (ab.alpha_s < 0) {
    ab.alpha_s = 0;
    ab.beta_s_per_byte = t1 / s2;
  } else if (ab.beta_s_per_byte < 0) {
    ab.beta_s_per_byte = 0;
    ab.alpha_s = t0 / s0;
  }
  return ab;
}

namespace {

// f32 elements of the whole tensor for `bytes`: rounded up to a multiple of the world size, so
// that reduce_scatter and allgather have equal blocks.
int64_t elements_for(int64_t bytes, int world) {
  const int64_t per_rank = (bytes + 4 * world - 1) / (4 * world);
  return std::max<int64_t>(per_rank, 1) * world;
}

}  // namespace

double AlphaBeta::seconds(int64_t bytes) const {
  ACC_CHECK(bytes >= 0, "collective time: bytes must be >= 0, got ", bytes);
  return alpha_s + beta_s_per_byte * static_cast<double>(bytes);
}

double CommCalibration::seconds(const std::string& op, int64_t bytes) const {
  auto it = ops.find(op);
  ACC_CHECK(it != ops.end(), "comm calibration: unknown collective '", op,
            "' (known: ", known_ops(), ")");
  return it->second.seconds(bytes);
}

double CommCalibration::wait_seconds(int64_t bytes, double gap_s) const {
  constexpr int64_t kSmall = 4 << 10;  // measure_collective_wait's default size, wait_s's
  double by_size = wait_s;
  if (wait_bulk_bytes > kSmall && bytes > kSmall) {
    const double f = std::min(
        1.0, static_cast<double>(bytes - kSmall) / static_cast<double>(wait_bulk_bytes - kSmall));
    by_size = wait_s + f * (wait_bulk_s - wait_s);
  }
  double by_gap = wait_s;
  if (wait_long_gap_s > wait_gap_s && gap_s > wait_gap_s) {
    const double f = std::min(1.0, (gap_s - wait_gap_s) / (wait_long_gap_s - wait_gap_s));
    by_gap = wait_s + f * (wait_long_s - wait_s);
  }
  return std::max(by_size, by_gap);
}

nlohmann::json CommCalibration::to_json() const {
  nlohmann::json j_ops = nlohmann::json::object(), j_points = nlohmann::json::object();
  for (const auto& [op, ab] : ops) {
    j_ops[op] = {{"alpha_s", ab.alpha_s}, {"beta_s_per_byte", ab.beta_s_per_byte}};
  }
  for (const auto& [op, pts] : points) {
    nlohmann::json list = nlohmann::json::array();
    for (const CommPoint& p : pts) list.push_back({p.bytes, p.seconds});
    j_points[op] = list;
  }
  nlohmann::json j = {{"world", world}, {"ops", j_ops}, {"points", j_points}};
  if (wait_s > 0) j["wait_s"] = wait_s;
  if (wait_bulk_bytes > 0) j["wait_bulk"] = {wait_bulk_bytes, wait_bulk_s};
  if (wait_gap_s > 0) j["wait_gap_s"] = wait_gap_s;
  if (wait_long_gap_s > 0) j["wait_long"] = {wait_long_gap_s, wait_long_s};
  return j;
}

CommCalibration CommCalibration::from_json(const nlohmann::json& j) {
  const std::string what = "comm calibration";
  json::Fields f(j, what);
  CommCalibration c;
  c.world = static_cast<int>(f.integer("world", 1, 1 << 24));
  json::Fields ops(f.at("ops"), what, "ops");
  for (const Collective& collective : kCollectives) {
    const char* op = collective.name;
    json::Fields ab(ops.at(op), what, ops.path(op));
    c.ops[op] = {ab.number("alpha_s", 0, false), ab.number("beta_s_per_byte", 0, false)};
    ab.no_others();
  }
  ops.no_others();
  if (f.optional("wait_s")) c.wait_s = f.number("wait_s", 0, false);
  if (const nlohmann::json* w = f.optional("wait_bulk")) {
    if (!w->is_array() || w->size() != 2 || !(*w)[0].is_number_integer() ||
        (*w)[0].get<int64_t>() <= (4 << 10) || !(*w)[1].is_number() ||
        !std::isfinite((*w)[1].get<double>()) || (*w)[1].get<double>() < 0) {
      f.fail(f.path("wait_bulk"), "must be [bytes > 4096, seconds >= 0], got " + json::brief(*w));
    }
    c.wait_bulk_bytes = (*w)[0].get<int64_t>();
    c.wait_bulk_s = (*w)[1].get<double>();
  }
  if (f.optional("wait_gap_s")) c.wait_gap_s = f.number("wait_gap_s", 0, false);
  if (const nlohmann::json* w = f.optional("wait_long")) {
    if (!w->is_array() || w->size() != 2 || !(*w)[0].is_number() || !(*w)[1].is_number() ||
        !std::isfinite((*w)[0].get<double>()) || (*w)[0].get<double>() <= c.wait_gap_s ||
        !std::isfinite((*w)[1].get<double>()) || (*w)[1].get<double>() < 0) {
      f.fail(f.path("wait_long"),
             "must be [gap_s > wait_gap_s, seconds >= 0], got " + json::brief(*w));
    }
    c.wait_long_gap_s = (*w)[0].get<double>();
    c.wait_long_s = (*w)[1].get<double>();
  }
  if (const nlohmann::json* pts = f.optional("points")) {
    json::Fields by_op(*pts, what, "points");
    for (auto it = pts->begin(); it != pts->end(); ++it) {
      const std::string path = by_op.path(it.key());
      if (!is_op(it.key())) by_op.fail(path, "is not a collective (expected " + known_ops() + ")");
      if (!it->is_array()) by_op.fail(path, "must be a list, got " + json::brief(*it));
      std::vector<CommPoint>& list = c.points[it.key()];
      for (size_t i = 0; i < it->size(); ++i) {
        const nlohmann::json& p = (*it)[i];
        const std::string pp = path + "[" + std::to_string(i) + "]";
        if (!p.is_array() || p.size() != 2 || !p[0].is_number_integer() ||
            p[0].get<int64_t>() < 1 || !p[1].is_number() || !std::isfinite(p[1].get<double>()) ||
            p[1].get<double>() < 0) {
          by_op.fail(pp, "must be [bytes >= 1, seconds >= 0], got " + json::brief(p));
        }
        list.push_back({p[0].get<int64_t>(), p[1].get<double>()});
      }
    }
  }
  f.no_others();
  return c;
}

CommCalibration calibrate_collectives_for_search(dist::ProcessGroup& group) {
  return calibrate_collectives(group, {4 << 10, 256 << 10, 4 << 20}, 0.01);
}

std::vector<int64_t> default_collective_sizes() {
  constexpr int64_t kKiB = 1024, kMiB = 1024 * kKiB;
  return {4 * kKiB, 64 * kKiB, 256 * kKiB, 1 * kMiB, 4 * kMiB, 16 * kMiB};
}

CommCalibration calibrate_collectives(dist::ProcessGroup& group,
                                      const std::vector<int64_t>& sizes_bytes,
                                      double seconds_per_point) {
  ACC_CHECK(!sizes_bytes.empty(), "calibrate_collectives: no sizes to measure");
  for (int64_t b : sizes_bytes) {
    ACC_CHECK(b >= 1, "calibrate_collectives: sizes must be >= 1 byte, got ", b);
  }
  ACC_CHECK(std::isfinite(seconds_per_point) && seconds_per_point > 0,
            "calibrate_collectives: seconds_per_point must be a positive finite number, got ",
            seconds_per_point);
  CommCalibration c;
  c.world = group.size();
  for (const Collective& op : kCollectives) c.ops[op.name] = AlphaBeta{};
  if (c.world == 1) return c;

  Timer timer;
  const int W = c.world;
  std::vector<int64_t> sizes = sizes_bytes;
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  const TensorOptions cpu{.device = Device::kCPU};
  // Each point is timed in kRounds rounds of seconds_per_point / kRounds, a round over every
  // (op, size) before the next: the point's time is the fastest round's. A round can fall into a
  // slow placement of the ranks' threads for all of its calls (three calibrations of 2 ranks on
  // 2 vCPUs, 2026-11-29: a 4 KiB all-reduce's median 21, 32 and 148 us, a reduce-scatter's 20, 20
  // and 101 us), and that one point then moved a fit's alpha 3x.
  constexpr int kRounds = 3;
  const double seconds_per_round = seconds_per_point / kRounds;
  std::vector<float> medians;  // per round, op and size: this rank's
  for (int round = 0; round < kRounds; ++round) {
    for (const Collective& op : kCollectives) {
      for (int64_t bytes : sizes) {
        const int64_t n = elements_for(bytes, W);
        // Zeros: sums stay zero over any number of repeats (no overflow to inf).
        Tensor whole = zeros({n}, cpu), block = zeros({n / W}, cpu);
        auto call = [&] { op.issue(group, whole, block)->wait(); };
        Timer warm;
        call();
        // Every rank must make the same number of calls: they agree on the slowest warm-up.
        Tensor slowest = from_vector(std::vector<float>{static_cast<float>(warm.elapsed_s())}, {1});
        group.allreduce(slowest, dist::ReduceOp::kMax)->wait();
        const double t_warm = std::max<double>(slowest.data<float>()[0], 1e-7);
        // At least one call a round, three over the rounds, as one round of three was before.
        const int repeats =
            static_cast<int>(std::clamp(std::ceil(seconds_per_round / t_warm), 1.0, 1000.0));
        std::vector<double> times;
        times.reserve(repeats);
        for (int r = 0; r < repeats; ++r) {
          Timer t;
          call();
          times.push_back(t.elapsed_s());
        }
        std::sort(times.begin(), times.end());
        const double median = repeats % 2 == 1
                                  ? times[repeats / 2]
                                  : 0.5 * (times[repeats / 2 - 1] + times[repeats / 2]);
        medians.push_back(static_cast<float>(median));
      }
    }
  }
  // The slowest rank's median is a round's time for the point, the fastest round the point's;
  // identical on every rank after this.
  Tensor all = from_vector(medians, {static_cast<int64_t>(medians.size())});
  group.allreduce(all, dist::ReduceOp::kMax)->wait();
  const size_t per_round = medians.size() / kRounds;
  size_t i = 0;
  for (const Collective& collective : kCollectives) {
    const char* op = collective.name;
    std::vector<CommPoint>& pts = c.points[op];
    for (int64_t bytes : sizes) {
      double fastest = all.data<float>()[i];
      for (int round = 1; round < kRounds; ++round) {
        fastest = std::min<double>(fastest, all.data<float>()[i + round * per_round]);
      }
      ++i;
      pts.push_back({elements_for(bytes, W) * 4, fastest});
    }
    c.ops[op] = fit_alpha_beta(pts);
    logging::debug("calibration: {} on '{}' ({} ranks): alpha {:.3g} s, {:.3g} GB/s", op,
                   group.name(), W, c.ops[op].alpha_s,
                   c.ops[op].beta_s_per_byte > 0 ? 1e-9 / c.ops[op].beta_s_per_byte : INFINITY);
  }
  logging::info("calibration: collectives of '{}' ({} ranks, {} sizes) in {:.2f} s", group.name(),
                W, sizes.size(), timer.elapsed_s());
  return c;
}

}  // namespace acc::search
