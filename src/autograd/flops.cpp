#include "acc/autograd/flops.hpp"

#include "acc/tensor/observer.hpp"
#include "acc/util/checked.hpp"

namespace acc::autograd {
namespace {
thread_local FlopCounter* current = nullptr;
}

int64_t matmul_flops(const char* op, int64_t count, int64_t m, int64_t k, int64_t n) {
  return checked_product({2, count, m, k, n}, op, ": FLOPs of ", count, " x (", m, ", ", k, ") @ (",
                         k, ", ", n, ")");
}

int64_t attention_flops(int64_t B, int64_t NH, int64_t T, int64_t HS, bool causal) {
  return checked_product({causal ? 2 : 4, B, NH, T, T, HS},
                         "attention: FLOPs of q (B, NH, T, HS) [", B, ", ", NH, ", ", T, ", ", HS,
                         "]");
}

int64_t FlopCount::total() const {
  return checked_add(forward, backward, "FLOPs forward + backward");
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
    int64_t& n = backward ? c->count_.backward : c->count_.forward;
    n = checked_add(n, flops, backward ? "backward" : "forward", " FLOPs of the step");
  }
}
}  // namespace detail

}  // namespace acc::autograd
