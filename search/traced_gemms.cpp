// The GEMMs of a traced step, read back from the matrix-product ops (src/autograd/ops_linalg.cpp
// is where each layout below is chosen).

#include <map>

#include "acc/search/calibration.hpp"
#include "gemm_ops.hpp"

namespace acc::search {

bool is_gemm_op(const std::string& op) {
  return detail::is_gemm_op(op);
}

std::vector<GemmCount> gemm_counts(const trace::Trace& t) {
  std::map<GemmShape, GemmCount> counts;
  for (trace::VertexId id : t.graph.ops()) {
    const trace::Vertex& v = t.graph.vertex(id);
    detail::for_each_gemm(v, [&](const GemmShape& s, int64_t calls) {
      detail::count_gemm(counts, s, calls, v.phase);
    });
  }
  return detail::sorted_counts(counts);
}

std::vector<GemmShape> gemm_shapes(const trace::Trace& t) {
  std::vector<GemmShape> out;
  for (const GemmCount& c : gemm_counts(t)) out.push_back(c.shape);
  return out;
}

}  // namespace acc::search
