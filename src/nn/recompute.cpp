#include "acc/nn/recompute.hpp"

#include <memory>

#include "acc/autograd/recompute.hpp"
#include "acc/autograd/saved.hpp"
#include "acc/nn/transformer.hpp"
#include "acc/util/error.hpp"

namespace acc::nn {
namespace {

std::vector<ModulePtr> submodules(const Module& root, const std::vector<std::string>& paths) {
  std::vector<ModulePtr> out;
  for (const auto& path : paths) out.push_back(root.submodule(path));
  return out;
}

}  // namespace

Undo wrap_forward(const std::vector<ModulePtr>& modules, const Module::ForwardWrapper& outer) {
  auto saved = std::make_shared<std::vector<std::pair<ModulePtr, Module::ForwardWrapper>>>();
  for (const ModulePtr& m : modules) {
    Module::ForwardWrapper inner = m->forward_wrapper();
    saved->emplace_back(m, inner);
    m->set_forward_wrapper([inner, outer](
                               Module& mod, const Tensor& x,
                               const std::function<Tensor(const Tensor&)>& fwd) -> Tensor {
      if (!inner) return outer(mod, x, fwd);
      // By value: acc::checkpoint keeps the function it is given for the recomputation in
      // backward, after this call (and the `fwd` it was handed) is gone.
      Module* self = &mod;
      return outer(mod, x, [inner, self, fwd](const Tensor& y) { return inner(*self, y, fwd); });
    });
  }
  return [saved] {
    for (auto it = saved->rbegin(); it != saved->rend(); ++it) {
      it->first->set_forward_wrapper(it->second);
    }
    saved->clear();
  };
}

Undo recompute_blocks(Module& root, const std::vector<std::string>& blocks) {
  return wrap_forward(
      submodules(root, blocks),
      [](Module&, const Tensor& x, const std::function<Tensor(const Tensor&)>& fwd) {
        return recompute(fwd, x);
      });
}

Undo recompute_attention_cores(Module& root, const std::vector<std::string>& blocks) {
  const AttentionCoreWrapper checkpointed = [](const AttentionCore& inner, const Tensor& q,
                                               const Tensor& k, const Tensor& v) {
    // By value: the recomputation replays `inner` in backward, after this call has returned.
    return recompute([inner](const std::vector<Tensor>& in) { return inner(in[0], in[1], in[2]); },
                     {q, k, v});
  };
  const std::vector<ModulePtr> modules = submodules(root, blocks);
  std::vector<Undo> undos;
  for (size_t i = 0; i < modules.size(); ++i) {
    try {
      undos.push_back(wrap_attention_cores(*modules[i], checkpointed));
    } catch (const ValueError& e) {
      undo_all(std::move(undos))();
      ACC_THROW(ValueError, "selective recomputation: block '", blocks[i], "': ", e.what());
    }
  }
  return undo_all(std::move(undos));
}

Undo bf16_activation_blocks(Module& root, const std::vector<std::string>& blocks) {
  return wrap_forward(
      submodules(root, blocks),
      [](Module&, const Tensor& x, const std::function<Tensor(const Tensor&)>& fwd) {
        Tensor y;
        {
          autograd::SaveActivationsInBf16 bf16;
          y = fwd(x);
        }
        return y.to(DType::kBFloat16).to(DType::kFloat32);
      });
}

}  // namespace acc::nn
