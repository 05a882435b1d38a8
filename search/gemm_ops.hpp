#pragma once
// The GEMMs of one matrix-product op, read back from its shapes and FLOPs
// (src/autograd/ops_linalg.cpp is where each layout below is chosen): what gemm_counts sums over
// a trace and what the time model's digest of a trace keeps of each op (ops_digest.hpp).

#include <map>
#include <string_view>
#include <vector>

#include "acc/search/calibration.hpp"
#include "acc/trace/graph.hpp"
#include "acc/util/checked.hpp"
#include "acc/util/error.hpp"

namespace acc::search::detail {

inline bool is_gemm_op(std::string_view op) {
  return op == "Linear" || op == "LinearBackward" || op == "Bmm" || op == "BmmBackward";
}

inline int64_t gemm_rows(const trace::TensorInfo& t, int64_t cols, const trace::Vertex& v) {
  ACC_CHECK_INTERNAL(cols > 0 && !t.shape.empty(), v.name, ": no columns in ", t.shape);
  return numel_of(t.shape) / cols;
}

// How many products of `per_product` FLOPs the op ran (its FLOPs are whole multiples).
inline int64_t gemm_products(const trace::Vertex& v, int64_t per_product) {
  ACC_CHECK_INTERNAL(per_product > 0 && v.flops % per_product == 0, v.name, ": ", v.flops,
                     " FLOPs are not a multiple of one product's ", per_product);
  return v.flops / per_product;
}

/// `add(shape, calls)` for each GEMM `v` ran: none unless it is a matrix-product op with FLOPs.
template <class Add>
void for_each_gemm(const trace::Vertex& v, const Add& add) {
  if (v.flops == 0) return;  // an empty product runs no GEMM
  if (v.op == "Linear") {
    // inputs x (..., IN), w (OUT, IN)[, bias]: y (M, OUT) = x (M, IN) @ w^T
    ACC_CHECK_INTERNAL(v.inputs.size() >= 2 && v.inputs[1].shape.size() == 2, v.name,
                       ": expects inputs x and w (OUT, IN)");
    const int64_t OUT = v.inputs[1].shape[0], IN = v.inputs[1].shape[1];
    const int64_t M = gemm_rows(v.inputs[0], IN, v);
    const GemmShape fwd{M, OUT, IN, false, true};
    ACC_CHECK_INTERNAL(gemm_products(v, fwd.flops()) == 1, v.name, ": FLOPs of more than one GEMM");
    add(fwd, 1);
  } else if (v.op == "LinearBackward") {
    // input g (M, OUT); outputs among dx (shape of x), dw (OUT, IN), db (OUT), as computed
    ACC_CHECK_INTERNAL(!v.inputs.empty() && !v.inputs[0].shape.empty() && !v.outputs.empty(),
                       v.name, ": expects the gradient of the output and at least one result");
    const int64_t OUT = v.inputs[0].shape.back(), M = gemm_rows(v.inputs[0], OUT, v);
    const auto& first = v.outputs[0];  // dx or dw when FLOPs were spent
    const int64_t IN = first.shape.back();
    const GemmShape dx{M, IN, OUT, false, false}, dw{OUT, IN, M, true, false};
    const int64_t n = gemm_products(v, dx.flops());
    ACC_CHECK_INTERNAL(n == 1 || n == 2, v.name, ": ", n, " products, expected 1 or 2");
    if (n == 2) {
      add(dx, 1);
      add(dw, 1);
    } else {
      // Only one of the two: dw has the weight's shape (when dx would too, both are the same
      // m, n, k).
      const bool is_dw = first.shape == Shape{OUT, IN};
      add(is_dw ? dw : dx, 1);
    }
  } else if (v.op == "Bmm") {
    // inputs a (L, M, K), b (L, K, N)
    ACC_CHECK_INTERNAL(
        v.inputs.size() == 2 && v.inputs[0].shape.size() == 3 && v.inputs[1].shape.size() == 3,
        v.name, ": expects inputs (L, M, K) and (L, K, N)");
    const int64_t L = v.inputs[0].shape[0], M = v.inputs[0].shape[1], K = v.inputs[0].shape[2],
                  N = v.inputs[1].shape[2];
    const GemmShape s{M, N, K, false, false};
    ACC_CHECK_INTERNAL(gemm_products(v, s.flops()) == L, v.name, ": FLOPs do not match ", L,
                       " products of ", s.str());
    add(s, L);
  } else if (v.op == "BmmBackward") {
    // input G (L, M, N); outputs dA (L, M, K) and/or dB (L, K, N)
    ACC_CHECK_INTERNAL(!v.inputs.empty() && v.inputs[0].shape.size() == 3 &&
                           (v.outputs.size() == 1 || v.outputs.size() == 2),
                       v.name, ": expects G (L, M, N) and one or two results");
    const int64_t L = v.inputs[0].shape[0], M = v.inputs[0].shape[1], N = v.inputs[0].shape[2];
    const int64_t n = static_cast<int64_t>(v.outputs.size());
    const int64_t K = gemm_products(v, checked_mul(GemmShape{M, N, 1}.flops(), L * n, v.name));
    const GemmShape da{M, K, N, false, true}, db{K, N, M, true, false};
    if (n == 2) {
      add(da, L);
      add(db, L);
    } else {
      const bool is_da = v.outputs[0].shape == Shape{L, M, K};
      add(is_da ? da : db, L);
    }
  }
}

/// Adds `calls` of `shape` in `phase` to `counts`.
inline void count_gemm(std::map<GemmShape, GemmCount>& counts, const GemmShape& shape,
                       int64_t calls, trace::Phase phase) {
  GemmCount& c = counts[shape];
  c.shape = shape;
  int64_t& n = phase == trace::Phase::kForward ? c.forward : c.backward;
  n = checked_add(n, calls, "calls of GEMM ", shape);  // formatted only when it throws
}

/// `counts`' entries, sorted by shape (gemm_counts' order).
inline std::vector<GemmCount> sorted_counts(const std::map<GemmShape, GemmCount>& counts) {
  std::vector<GemmCount> out;
  out.reserve(counts.size());
  for (const auto& [shape, c] : counts) out.push_back(c);
  return out;
}

}  // namespace acc::search::detail
