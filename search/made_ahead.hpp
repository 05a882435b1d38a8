#pragma once
// Making a search's figures ahead, on the configured threads (MemoryModel::expect,
// CostModel::expect).

#include <cstddef>
#include <cstdint>
#include <vector>

#include "acc/tensor/threading.hpp"
#include "acc/util/error.hpp"

namespace acc::search::detail {

/// For each group (on the configured threads, acc::set_num_threads), `make(item, out)` for its
/// items in order on one thread, `out` that group's result: the items of one group share a model
/// that is never traced twice at once, and which of them makes a shared trace does not depend on
/// the threads' timing. An item the model refuses (acc::ValueError, ShapeError or TypeError: a
/// layout, depth or batch it cannot run) is left out: the prediction that asks for it says why.
/// Returns the groups' results in the groups' order.
template <class Out, class Item, class Make>
std::vector<Out> made_ahead(const std::vector<const std::vector<Item>*>& groups, const Make& make) {
  std::vector<Out> made(groups.size());
  parallel_for(static_cast<int64_t>(groups.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      Out& out = made[static_cast<size_t>(g)];
      for (const Item& item : *groups[static_cast<size_t>(g)]) {
        try {
          make(item, out);
        } catch (const ValueError&) {
        } catch (const ShapeError&) {
        } catch (const TypeError&) {
        }
      }
    }
  });
  return made;
}

}  // namespace acc::search::detail
