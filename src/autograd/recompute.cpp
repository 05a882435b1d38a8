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
  return recompute([fn](const std::vector<Tensor>& in) { return fn(in[0]); }, {x});
}

Tensor recompute(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                 const std::vector<Tensor>& inputs) {
  ACC_CHECK(!inputs.empty(), "recompute: expects at least one input, got none");
  if (!autograd::any_requires_grad(inputs)) return fn(inputs);
  Generator& gen = default_generator();
  const uint64_t seed = gen.seed(), offset = gen.offset();
  Tensor out;
  {
    NoGradGuard no_grad;
    out = fn(inputs);
  }
  // An identity function: give the node its own output.
  for (const Tensor& x : inputs) {
    if (out.is_same(x)) out = x.detach();
  }
  // The node's inputs are `inputs`; parameters inside fn are reached by the inner backward.
  std::vector<Tensor> saved;
  std::vector<bool> wants_grad;
  for (const Tensor& x : inputs) {
    saved.push_back(x.detach());
    wants_grad.push_back(x.requires_grad());
  }
  autograd::record_op("RecomputeBackward", inputs, {out},
                      [fn, saved, wants_grad, seed, offset](const std::vector<Tensor>& g,
                                                            const std::vector<bool>&) {
                        // The generator is written only when it moved: meta traces (the
                        // search's, on several threads at once) read it and never advance it.
                        Generator& gen = default_generator();
                        const uint64_t now_seed = gen.seed(), now_offset = gen.offset();
                        const bool moved = now_seed != seed || now_offset != offset;
                        if (moved) gen.set_state(seed, offset);
                        std::vector<Tensor> again;
                        for (size_t i = 0; i < saved.size(); ++i) {
                          Tensor input = saved[i].detach();
                          if (wants_grad[i]) input.set_requires_grad(true);
                          again.push_back(std::move(input));
                        }
                        Tensor y;
                        {
                          GradModeGuard grad_on(true);
                          y = fn(again);
                        }
                        if (moved || gen.seed() != now_seed || gen.offset() != now_offset) {
                          gen.set_state(now_seed, now_offset);
                        }
                        if (y.requires_grad()) autograd::backward({y}, {g[0]});
                        std::vector<Tensor> grads;
                        for (size_t i = 0; i < again.size(); ++i) {
                          grads.push_back(wants_grad[i] ? again[i].grad() : Tensor());
                        }
                        return grads;
                      });
  return out;
}

}  // namespace acc
