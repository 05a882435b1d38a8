#include "acc/autograd/flops.hpp"

#include "acc/tensor/observer.hpp"

namespace acc::autograd {
namespace {
thread_local FlopCounter* current = nullptr;
}

FlopCounter::FlopCounter() : prev_(current) {
  current = this;
}
FlopCounter::~FlopCounter() {
  current = prev_;
}

namespace detail {
void add_flops(int64_t flops, bool backward) {
  if (acc::detail::OpObserver* obs = acc::detail::op_observer()) obs->on_flops(flops, backward);
  for (FlopCounter* c = current; c != nullptr; c = c->prev_) {
    (backward ? c->count_.backward : c->count_.forward) += flops;
  }
}
}  // namespace detail

}  // namespace acc::autograd
