#pragma once
// What the differentiable collectives (functional.cpp) and messages (p2p.cpp) share: the checks
// every op makes and the report of its communication to the tracer.

#include <string>

#include "acc/dist/process_group.hpp"
#include "acc/tensor/observer.hpp"
#include "acc/tensor/tensor.hpp"
#include "acc/util/error.hpp"

namespace acc::dist::detail {

inline void check_group(const ProcessGroupPtr& group, const char* op) {
  ACC_CHECK(group != nullptr, op, ": no process group");
}

/// f32 or bf16; on a meta group only meta tensors.
inline void check_tensor_on(const Tensor& x, const ProcessGroup& g, const char* op,
                            const char* what) {
  ACC_CHECK(x.defined(), op, ": ", what, " is undefined");
  ACC_CHECK_TYPE(x.dtype() == DType::kFloat32 || x.dtype() == DType::kBFloat16, op, ": ", what,
                 " must be f32 or bf16, got ", x.dtype());
  ACC_CHECK_TYPE(x.is_meta() || !g.is_meta(), op, ": ", what, " is a ", x.device(),
                 " tensor but group '", g.name(), "' is a meta group (rank ", g.rank(), " of ",
                 g.size(), ", no communicator): it carries meta tensors only");
}

/// Tells the tracer (if any) about the op's communication. Called last, right before the op's
/// on_op: by a forward op just before autograd::record_op, by a backward closure as it returns.
inline void report_comm(CommKind kind, const ProcessGroup& g, int64_t bytes, int peer = -1) {
  if (::acc::detail::OpObserver* obs = ::acc::detail::op_observer()) {
    obs->on_comm(CommRecord{kind, g.name(), g.size(), bytes, peer});
  }
}

}  // namespace acc::dist::detail
