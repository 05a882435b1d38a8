#include "entries.hpp"

#include "acc/util/error.hpp"

namespace acc::ckpt::detail {

using dist::PlacementEntry;
using dist::TensorKind;

bool saved_kind(TensorKind k) {
  return k == TensorKind::kParameter || k == TensorKind::kOptimizerState;
}

void check_region(const PlacementEntry& e) {
  bool inside =
      e.box.offsets.size() == e.global_shape.size() && e.box.sizes.size() == e.global_shape.size();
  for (size_t k = 0; inside && k < e.box.sizes.size(); ++k) {
    inside = e.box.offsets[k] >= 0 && e.box.sizes[k] >= 0 &&
             e.box.sizes[k] <= e.global_shape[k] - e.box.offsets[k];
  }
  if (inside && e.flat) {
    inside = e.flat->offset >= 0 && e.flat->length >= 0 &&
             e.flat->length <= e.box.numel() - e.flat->offset;
  }
  ACC_CHECK(inside, "checkpoint: '", e.name, "' holds box ", e.box.to_string(),
            e.flat ? " flat [" + std::to_string(e.flat->offset) + ", " +
                         std::to_string(e.flat->end()) + ")"
                   : std::string(),
            ", which is not inside its tensor of shape ", to_string(e.global_shape));
}

bool written_here(const PlacementEntry& e) {
  return saved_kind(e.kind) && e.replica == 0 && e.held_numel() > 0;
}

Tensor contiguous_local(const PlacementEntry& e) {
  check_region(e);
  ACC_CHECK(e.local.numel() == e.held_numel(), "checkpoint: '", e.name, "' holds ", e.local.numel(),
            " elements for a region of ", e.held_numel());
  ACC_CHECK_TYPE(e.local.dtype() == e.dtype, "checkpoint: '", e.name, "' is ", e.local.dtype(),
                 ", its placement says ", e.dtype);
  return e.local.contiguous();
}

}  // namespace acc::ckpt::detail
