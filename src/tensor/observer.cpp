#include "acc/tensor/observer.hpp"

#include "acc/util/progress.hpp"

namespace acc {

const char* comm_kind_name(CommKind k) {
  switch (k) {
    case CommKind::kAllreduce:
      return "allreduce";
    case CommKind::kAllgather:
      return "allgather";
    case CommKind::kReduceScatter:
      return "reduce_scatter";
    case CommKind::kAlltoall:
      return "alltoall";
    case CommKind::kBroadcast:
      return "broadcast";
    case CommKind::kSend:
      return "send";
    case CommKind::kRecv:
      return "recv";
  }
  return "?";
}

}  // namespace acc

namespace acc::detail {
namespace {
thread_local OpObserver* tls_observer = nullptr;
thread_local std::vector<std::string> tls_scopes;
const std::string kEmpty;
}  // namespace

OpObserver* op_observer() {
  return tls_observer;
}

OpObserver* set_op_observer(OpObserver* obs) {
  OpObserver* prev = tls_observer;
  tls_observer = obs;
  return prev;
}

void push_scope(std::string scope) {
  tls_scopes.push_back(std::move(scope));
  progress::module(tls_scopes.back());
}
void pop_scope() {
  if (!tls_scopes.empty()) tls_scopes.pop_back();
  progress::module(current_scope());
}
const std::string& current_scope() {
  return tls_scopes.empty() ? kEmpty : tls_scopes.back();
}

}  // namespace acc::detail
