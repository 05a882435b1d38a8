// A cluster profile: reading it and the prices it gives (cluster.hpp says what each figure
// prices).

#include "acc/search/cluster.hpp"

#include <algorithm>
#include <cmath>

#include "acc/util/error.hpp"
#include "acc/util/json.hpp"
#include "acc/util/json_fields.hpp"

namespace acc::search {

using json::brief;
using json::Fields;

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// Members of a group of `size` ranks `stride` apart that share a node of `per_node` devices.
int members_per_node(int size, int stride, int per_node) {
  if (stride >= per_node) return 1;
  return std::max(1, std::min(size, per_node / stride));
}

double link_seconds(const ClusterProfile::Link& l, double bytes) {
  return bytes / (l.gbps * 1e9 * l.efficiency);
}

}  // namespace

double ClusterProfile::gemm_efficiency_at(const GemmShape& s) const {
  const int64_t dim = std::max<int64_t>(1, std::min({s.m, s.n, s.k}));
  const auto& pts = gemm_efficiency;
  if (dim <= pts.front().dim) return pts.front().efficiency;
  if (dim >= pts.back().dim) return pts.back().efficiency;
  for (size_t i = 1; i < pts.size(); ++i) {
    if (dim > pts[i].dim) continue;
    const double x0 = std::log2(static_cast<double>(pts[i - 1].dim));
    const double x1 = std::log2(static_cast<double>(pts[i].dim));
    const double f = (std::log2(static_cast<double>(dim)) - x0) / (x1 - x0);
    return pts[i - 1].efficiency + f * (pts[i].efficiency - pts[i - 1].efficiency);
  }
  return pts.back().efficiency;
}

double ClusterProfile::gemm_seconds(const GemmShape& s, bool bf16) const {
  if (s.m == 0 || s.n == 0 || s.k == 0) return 0;
  const double rate = peak_tflops(bf16) * 1e12 * gemm_efficiency_at(s);
  return static_cast<double>(s.flops()) / rate + kernel_overhead_s;
}

double ClusterProfile::memory_seconds(int64_t bytes) const {
  ACC_CHECK(bytes >= 0, "cluster profile: bytes must be >= 0, got ", bytes);
  return static_cast<double>(bytes) / (memory_gbps * 1e9 * memory_efficiency) + kernel_overhead_s;
}

double ClusterProfile::collective_seconds(const std::string& op, int64_t bytes,
                                          GroupPlacement group) const {
  ACC_CHECK(bytes >= 0, "cluster profile: ", op, " of ", bytes, " bytes: must be >= 0");
  ACC_CHECK(group.size >= 1 && group.stride >= 1, "cluster profile: a group of ", group.size,
            " rank(s) ", group.stride, " apart");
  const bool known = op == "allreduce" || op == "reduce_scatter" || op == "allgather" ||
                     op == "broadcast" || op == "alltoall";
  ACC_CHECK(known, "cluster profile: unknown collective '", op,
            "' (known: allreduce, reduce_scatter, allgather, broadcast, alltoall)");
  const int n = group.size;
  if (n <= 1) return 0;
  const int g = members_per_node(n, group.stride, devices_per_node);
  const int k = std::max(1, n / g);
  const double B = static_cast<double>(bytes);
  const double gi = g, ki = k;
  // One ring pass (reduce-scatter or all-gather): (g - 1) / g of the buffer over NVLink, and each
  // member's 1 / g share of it (k - 1) / k over its own NIC.
  const double intra = g > 1 ? link_seconds(intra_node, (gi - 1) / gi * B) : 0.0;
  const double inter = k > 1 ? link_seconds(inter_node, (ki - 1) / ki * B / gi) : 0.0;
  const double step = k > 1 ? inter_node.latency_s : intra_node.latency_s;
  const double pass = intra + inter + static_cast<double>(n - 1) * step;
  if (op == "allreduce") return 2 * pass;
  if (op == "reduce_scatter" || op == "allgather") return pass;
  if (op == "broadcast") {
    // Pipelined down the ring: the whole buffer over the slowest link once.
    return (k > 1 ? link_seconds(inter_node, B) : link_seconds(intra_node, B)) +
           static_cast<double>(n - 1) * step;
  }
  // alltoall: each rank sends (n - 1) / n of its buffer; (n - g) / n of it leaves the node.
  const double out_intra = g > 1 ? link_seconds(intra_node, (gi - 1) / n * B) : 0.0;
  const double out_inter = k > 1 ? link_seconds(inter_node, (n - gi) / n * B) : 0.0;
  return std::max(out_intra, out_inter) + step;
}

double ClusterProfile::p2p_seconds(int64_t bytes, int stride) const {
  const bool inter = stride >= devices_per_node;
  const Link& l = inter ? inter_node : intra_node;
  return l.latency_s + link_seconds(l, static_cast<double>(bytes));
}

nlohmann::json ClusterProfile::to_json() const {
  nlohmann::json curve = nlohmann::json::array();
  for (const auto& p : gemm_efficiency) curve.push_back({p.dim, p.efficiency});
  auto link = [](const Link& l) {
    return nlohmann::json{
        {"gbps", l.gbps}, {"latency_us", l.latency_s * 1e6}, {"efficiency", l.efficiency}};
  };
  return {{"name", name},
          {"source", source},
          {"device",
           {{"name", device_name},
            {"peak_tflops", {{"fp32", peak_tflops_fp32}, {"bf16", peak_tflops_bf16}}},
            {"gemm_efficiency", curve},
            {"memory_gbps", memory_gbps},
            {"memory_efficiency", memory_efficiency},
            {"memory_gib", static_cast<double>(memory_bytes) / kGiB},
            {"reserved_gib", static_cast<double>(reserved_bytes) / kGiB},
            {"kernel_overhead_us", kernel_overhead_s * 1e6}}},
          {"system",
           {{"devices_per_node", devices_per_node},
            {"intra_node", link(intra_node)},
            {"inter_node", link(inter_node)}}},
          {"software", {{"attention", attention == Attention::kFused ? "fused" : "materialized"}}}};
}

ClusterProfile ClusterProfile::from_json(const nlohmann::json& j) {
  const std::string what = "cluster profile";
  Fields f(j, what);
  ClusterProfile p;
  p.name = f.string("name");
  if (f.optional("source")) p.source = f.string("source");
  auto fraction = [](Fields& o, const std::string& field) {
    const double v = o.number(field, 0, true);
    if (v > 1) o.fail(o.path(field), "must be a fraction in (0, 1], got " + std::to_string(v));
    return v;
  };
  {
    Fields d(f.at("device"), what, "device");
    p.device_name = d.string("name");
    Fields peak(d.at("peak_tflops"), what, "device.peak_tflops");
    p.peak_tflops_fp32 = peak.number("fp32", 0, true);
    p.peak_tflops_bf16 = peak.number("bf16", 0, true);
    peak.no_others();
    const nlohmann::json& curve = d.at("gemm_efficiency");
    if (!curve.is_array() || curve.empty()) {
      d.fail("device.gemm_efficiency",
             "must be a non-empty list of [dim, efficiency], got " + brief(curve));
    }
    for (size_t i = 0; i < curve.size(); ++i) {
      const std::string at = "device.gemm_efficiency[" + std::to_string(i) + "]";
      const nlohmann::json& pt = curve[i];
      if (!pt.is_array() || pt.size() != 2 || !pt[0].is_number_integer() || !pt[1].is_number()) {
        d.fail(at, "must be [dim, efficiency] (an integer and a number), got " + brief(pt));
      }
      const GemmPoint g{pt[0].get<int64_t>(), pt[1].get<double>()};
      if (g.dim < 1) d.fail(at, "has a dim below 1: " + brief(pt));
      if (!(g.efficiency > 0 && g.efficiency <= 1)) {
        d.fail(at, "has an efficiency outside (0, 1]: " + brief(pt));
      }
      if (!p.gemm_efficiency.empty() && g.dim <= p.gemm_efficiency.back().dim) {
        d.fail(at,
               "must come after a smaller dim (the points go in increasing dim), got " + brief(pt));
      }
      p.gemm_efficiency.push_back(g);
    }
    p.memory_gbps = d.number("memory_gbps", 0, true);
    p.memory_efficiency = fraction(d, "memory_efficiency");
    const double gib = d.number("memory_gib", 0, true);
    const double reserved = d.number("reserved_gib", 0, false);
    if (reserved >= gib) {
      d.fail("device.reserved_gib", "must be below memory_gib (" + std::to_string(gib) + "), got " +
                                        std::to_string(reserved));
    }
    p.memory_bytes = static_cast<int64_t>(gib * kGiB);
    p.reserved_bytes = static_cast<int64_t>(reserved * kGiB);
    p.kernel_overhead_s = d.number("kernel_overhead_us", 0, false) * 1e-6;
    d.no_others();
  }
  {
    Fields s(f.at("system"), what, "system");
    p.devices_per_node = static_cast<int>(s.integer("devices_per_node", 1, 1 << 16));
    auto link = [&](const std::string& name) {
      Fields l(s.at(name), what, "system." + name);
      Link out;
      out.gbps = l.number("gbps", 0, true);
      out.latency_s = l.number("latency_us", 0, false) * 1e-6;
      out.efficiency = fraction(l, "efficiency");
      l.no_others();
      return out;
    };
    p.intra_node = link("intra_node");
    p.inter_node = link("inter_node");
    s.no_others();
  }
  if (const nlohmann::json* sw = f.optional("software")) {
    Fields s(*sw, what, "software");
    const std::string a = s.string("attention");
    if (a != "fused" && a != "materialized") {
      s.fail("software.attention", "must be \"fused\" or \"materialized\", got \"" + a + "\"");
    }
    p.attention = a == "fused" ? Attention::kFused : Attention::kMaterialized;
    s.no_others();
  }
  f.no_others();
  return p;
}

ClusterProfile ClusterProfile::load(const std::string& path) {
  const nlohmann::json j = read_json_file(path, "--cluster");
  try {
    return from_json(j);
  } catch (const ValueError& e) {
    ACC_THROW(ValueError, "--cluster '", path, "': ", e.what());
  }
}

}  // namespace acc::search
