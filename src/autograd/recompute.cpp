#include "acc/autograd/recompute.hpp"

#include "acc/autograd/engine.hpp"
#include "acc/tensor/node.hpp"
#include "acc/tensor/random.hpp"
#include "acc/util/error.hpp"

namespace acc {

Tensor recompute(const std::function<Tensor(const Tensor&)>& fn, const Tensor& x) {
  // The recomputation is attached to x's gradient edge; without one there is nothing to hang it
  // on, so the block runs normally (a model's first block input requires grad through the
  // embedding, so this is the rare case of a frozen front).
  if (!GradMode::is_enabled() || !x.requires_grad()) return fn(x);
  Generator& gen = default_generator();
  const uint64_t seed = gen.seed(), offset = gen.offset();
  Tensor out;
  {
    NoGradGuard no_grad;
    out = fn(x);
  }
  if (out.is_same(x)) out = x.detach();  // an identity block: give the node its own output
  // The node's input is x; parameters inside fn are reached by the inner backward.
  Tensor saved = x.detach();
  autograd::record_op(
      "RecomputeBackward", {x}, {out},
      [fn, saved, seed, offset](const std::vector<Tensor>& g, const std::vector<bool>&) {
        Generator& gen = default_generator();
        const uint64_t now_seed = gen.seed(), now_offset = gen.offset();
        gen.set_state(seed, offset);
        Tensor input = saved.detach();
        input.set_requires_grad(true);
        Tensor y;
        {
          GradModeGuard grad_on(true);
          y = fn(input);
        }
        gen.set_state(now_seed, now_offset);
        if (y.requires_grad()) autograd::backward({y}, {g[0]});
        return std::vector<Tensor>{input.grad()};
      });
  return out;
}

}  // namespace acc
