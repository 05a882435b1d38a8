#include "entries.hpp"

#include "acc/util/error.hpp"

namespace acc::ckpt::detail {

using dist::FlatRange;
using dist::PlacementEntry;
using dist::TensorKind;

FlatRange range_of(const PlacementEntry& e) {
  const auto runs = e.global_runs();
  if (runs.empty()) return {0, 0};
  ACC_CHECK(runs.size() == 1, "checkpoint: '", e.name, "' holds box ", e.box.to_string(), " of ",
            to_string(e.global_shape), ", which is ", runs.size(),
            " ranges of the tensor; checkpoint format version 1 stores one range per rank");
  return runs.front().first;
}

bool saved_kind(TensorKind k) {
  return k == TensorKind::kParameter || k == TensorKind::kOptimizerState;
}

bool written_here(const PlacementEntry& e) {
  return saved_kind(e.kind) && e.replica == 0 && range_of(e).length > 0;
}

const char* kind_name(TensorKind k) {
  return k == TensorKind::kParameter ? "parameter" : "optimizer_state";
}

Tensor contiguous_local(const PlacementEntry& e) {
  ACC_CHECK(e.local.numel() == range_of(e).length, "checkpoint: '", e.name, "' holds ",
            e.local.numel(), " elements for a range of ", range_of(e).length);
  ACC_CHECK_TYPE(e.local.dtype() == e.dtype, "checkpoint: '", e.name, "' is ", e.local.dtype(),
                 ", its placement says ", e.dtype);
  return e.local.contiguous();
}

}  // namespace acc::ckpt::detail
