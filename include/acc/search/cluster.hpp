#pragma once
// A cluster that is not at hand, described by datasheet figures and stated efficiencies, so that
// the search's cost model can price a plan for it (acc-search --plan-only --cluster FILE).
//
// A profile is JSON (search/profiles/*.json ship A100-80GB SXM in a DGX A100 / Selene-like cluster
// and H100-80GB SXM in DGX H100 nodes):
//
//   {"name": "...", "source": "where the figures come from",
//    "device": {"name": "A100-SXM4-80GB",
//               "peak_tflops": {"fp32": 19.5, "bf16": 312},
//               "gemm_efficiency": [[64, 0.30], [4096, 0.80], ...],
//               "memory_gbps": 2039, "memory_efficiency": 0.85,
//               "memory_gib": 80, "reserved_gib": 4, "kernel_overhead_us": 4},
//    "system": {"devices_per_node": 8,
//               "intra_node": {"gbps": 300, "latency_us": 5, "efficiency": 0.75},
//               "inter_node": {"gbps": 25, "latency_us": 10, "efficiency": 0.85}},
//    "software": {"attention": "materialized" | "fused"}}
//
// What each figure prices (ClusterProfile's methods below):
//  - A GEMM: its FLOPs at the dtype's peak times the efficiency of its smallest dimension
//    (gemm_efficiency: points (dim, fraction of peak), linear in log2(dim) between them, flat
//    beyond the ends). An amp candidate's GEMMs run in bf16, another's in fp32.
//  - Any other op: its bytes at memory_gbps x memory_efficiency, plus kernel_overhead_us (one
//    launch and its tail); half its traced bytes under amp (activations in 16 bits). A view (an
//    op whose every output shares an input's storage) launches nothing and costs nothing.
//  - The attention core: "fused" (a FlashAttention-like kernel): its traced FLOPs at the
//    efficiency of its head dimension; "materialized" (what Megatron-LM ran in 2021): the two
//    batched products over the whole s x s scores (the causal mask applied, not skipped) as GEMMs,
//    plus the scores' elementwise passes in 16 bits (scale-mask-softmax and dropout: 9 bytes a
//    score forward, 11 backward).
//  - A collective over a group (GroupPlacement: its size and the distance between its ranks; the
//    mesh puts tp innermost, then cp, dp, pp): the ring algorithm NCCL uses for large messages,
//    g members a node over intra_node, k nodes over inter_node, each device with its own NIC
//    (a DGX's 8 HCAs): all-reduce 2 (g-1)/g B / bw_intra + 2 (k-1)/k B / (g bw_inter), reduce-
//    scatter and all-gather half of it, a latency per ring step; bandwidths are per device and
//    direction, times their efficiency. A send/receive: one latency plus its bytes over the link
//    between the two ranks.
//  - Memory: memory_gib less reserved_gib (the CUDA context, NCCL's buffers, the allocator's
//    fragmentation) is the budget of a plan.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "acc/search/calibration.hpp"

namespace acc::search {

/// A communication group on the cluster: `size` ranks, `stride` ranks apart (tp: 1; cp: tp; the
/// dp x cp group: tp; pp's neighbours: tp x cp x dp).
struct GroupPlacement {
  int size = 1;
  int stride = 1;
};

struct ClusterProfile {
  struct GemmPoint {
    int64_t dim = 0;        // the smallest of m, n, k
    double efficiency = 0;  // fraction of the dtype's peak
  };
  struct Link {
    double gbps = 0;  // GB/s (1e9 B/s) per device and direction
    double latency_s = 0;
    double efficiency = 1;  // the fraction of gbps a collective's ring achieves
  };
  enum class Attention { kFused, kMaterialized };

  std::string name;
  std::string source;
  // The device.
  std::string device_name;
  double peak_tflops_fp32 = 0;
  double peak_tflops_bf16 = 0;
  std::vector<GemmPoint> gemm_efficiency;
  double memory_gbps = 0;
  double memory_efficiency = 1;
  int64_t memory_bytes = 0;
  int64_t reserved_bytes = 0;
  double kernel_overhead_s = 0;
  // The system.
  int devices_per_node = 1;
  Link intra_node, inter_node;
  // The software stack the plan runs on.
  Attention attention = Attention::kFused;

  /// The fraction of peak a GEMM of smallest dimension min(m, n, k) achieves.
  double gemm_efficiency_at(const GemmShape& s) const;
  /// TFLOP/s the device peaks at: bf16 (amp) or fp32.
  double peak_tflops(bool bf16) const { return bf16 ? peak_tflops_bf16 : peak_tflops_fp32; }
  /// FLOPs of `s` at the dtype's peak times gemm_efficiency_at(s), plus one kernel's overhead.
  double gemm_seconds(const GemmShape& s, bool bf16) const;
  /// A memory-bound kernel moving `bytes` (read + written): bytes at the achievable bandwidth
  /// plus one kernel's overhead.
  double memory_seconds(int64_t bytes) const;
  /// A collective ("allreduce", "reduce_scatter", "allgather", "broadcast", "alltoall") of
  /// `bytes` (the whole buffer, as CommCalibration counts it) over `group`. 0 on a group of one.
  /// Throws acc::ValueError naming an unknown op or negative bytes.
  double collective_seconds(const std::string& op, int64_t bytes, GroupPlacement group) const;
  /// One message of `bytes` between two ranks `stride` apart.
  double p2p_seconds(int64_t bytes, int stride) const;
  /// What a plan may use of a device: memory_bytes - reserved_bytes.
  int64_t budget_bytes() const { return memory_bytes - reserved_bytes; }

  nlohmann::json to_json() const;
  /// Every field required but "source" and "software", no others; figures positive and finite,
  /// efficiencies in (0, 1], gemm_efficiency points in increasing dim. Throws acc::ValueError
  /// "cluster profile: field '<path>' ..." naming the field by its path.
  static ClusterProfile from_json(const nlohmann::json& j);
  /// from_json of the file; the error names the file. Throws acc::IoError when it cannot be read.
  static ClusterProfile load(const std::string& path);
};

}  // namespace acc::search
