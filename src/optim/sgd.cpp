#include "acc/optim/sgd.hpp"

#include <type_traits>

#include "acc/tensor/threading.hpp"
#include "acc/util/error.hpp"
#include "optim_util.hpp"

namespace acc::optim {

namespace {

struct SgdCoeffs {
  float weight_decay;
  float momentum;
  float one_minus_dampening;
  float neg_lr;
  float grad_scale;  // g *= grad_scale first (fused gradient clipping)
};

// p (n), g (n), buf (n) or null. Same float operation order as torch's _single_tensor_sgd:
//   d = g + wd * p;  buf = d (first) | buf * momentum + (1 - dampening) * d;
//   d = d + momentum * buf (nesterov) | buf;  p = p + (-lr) * d
template <bool kDecay, bool kMomentum, bool kNesterov, bool kFirst, bool kScaled>
void sgd_kernel(float* __restrict p, const float* __restrict g, float* __restrict buf, int64_t n,
                const SgdCoeffs& c) {
  parallel_for(n, detail::kUpdateGrain, [&](int64_t begin, int64_t end) {
    // Staged only when the scaled gradient feeds an addition (the weight-decay term).
    constexpr bool kStaged = kScaled && kDecay;
    detail::with_scaled_grad<kStaged>(
        g, c.grad_scale, begin, end,
        [&](const float* __restrict gp, int64_t lo, int64_t hi, int64_t base) {
          for (int64_t i = lo; i < hi; ++i) {
            float d = gp[i - base];
            if constexpr (kScaled && !kStaged) d = d * c.grad_scale;
            if constexpr (kDecay) d = d + c.weight_decay * p[i];
            if constexpr (kMomentum) {
              float b;
              if constexpr (kFirst) {
                b = d;
              } else {
                b = buf[i] * c.momentum + c.one_minus_dampening * d;
              }
              buf[i] = b;
              if constexpr (kNesterov) {
                d = d + c.momentum * b;
              } else {
                d = b;
              }
            }
            p[i] = p[i] + c.neg_lr * d;
          }
        });
  });
}

template <class F>
void with_bool(bool value, F&& f) {
  if (value) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

SGD::Options merge(const SGD::Options& defaults, ParamGroup& group) {
  SGD::Options o = defaults;
  if (group.lr) o.lr = *group.lr;
  if (group.momentum) o.momentum = *group.momentum;
  if (group.dampening) o.dampening = *group.dampening;
  if (group.weight_decay) o.weight_decay = *group.weight_decay;
  if (group.nesterov) o.nesterov = *group.nesterov;
  return o;
}

void validate(const SGD::Options& o, const std::string& who) {
  detail::check_non_negative(who, "lr", o.lr);
  detail::check_non_negative(who, "momentum", o.momentum);
  detail::check_range(who, "dampening", o.dampening, 0.0, 1.0, /*hi_inclusive=*/true);
  detail::check_non_negative(who, "weight_decay", o.weight_decay);
  ACC_CHECK(!o.nesterov || (o.momentum > 0 && o.dampening == 0), who,
            ": nesterov needs momentum > 0 and dampening == 0, got momentum ", o.momentum,
            " and dampening ", o.dampening);
}

}  // namespace

SGD::SGD(NamedParams params, Options options)
    : SGD(std::vector<ParamGroup>{ParamGroup{.params = std::move(params)}}, options) {}

SGD::SGD(std::vector<ParamGroup> groups, Options defaults) : defaults_(defaults) {
  validate(defaults_, "sgd");
  init(std::move(groups));
}

OptimizerFactory SGD::factory(Options options) {
  validate(options, "sgd");
  return {[options](std::vector<ParamGroup> groups) -> std::unique_ptr<Optimizer> {
            return std::make_unique<SGD>(std::move(groups), options);
          },
          nullptr};
}

OptimizerFactory SGD::factory(Options options, ParamGrouping grouping) {
  validate(options, "sgd");
  ACC_CHECK(grouping != nullptr, "sgd: factory got an empty grouping function");
  return {[options](std::vector<ParamGroup> groups) -> std::unique_ptr<Optimizer> {
            return std::make_unique<SGD>(std::move(groups), options);
          },
          std::move(grouping)};
}

void SGD::resolve_group(ParamGroup& group, size_t index) const {
  const std::string who = "sgd: param group " + std::to_string(index);
  ACC_CHECK(!group.betas && !group.eps, who, " sets ", group.betas ? "betas" : "eps",
            ", which sgd does not use");
  const Options o = merge(defaults_, group);
  validate(o, who);
  group.lr = o.lr;
  group.momentum = o.momentum;
  group.dampening = o.dampening;
  group.weight_decay = o.weight_decay;
  group.nesterov = o.nesterov;
}

std::vector<std::string> SGD::buffer_names(const ParamGroup& group) const {
  if (*group.momentum == 0.0) return {};
  return {"momentum_buffer"};
}

void SGD::update(const ParamGroup& group, ParamState& state, const Tensor& grad) {
  const double momentum = *group.momentum;
  const SgdCoeffs c{static_cast<float>(*group.weight_decay), static_cast<float>(momentum),
                    static_cast<float>(1.0 - *group.dampening), static_cast<float>(-*group.lr),
                    grad_scale()};
  float* p = state.param.data<float>();
  const float* g = grad.data<float>();
  float* buf = momentum != 0.0 ? state.buffers[0].data<float>() : nullptr;
  const int64_t n = state.param.numel();
  with_bool(*group.weight_decay != 0.0, [&](auto decay) {
    with_bool(momentum != 0.0, [&](auto mom) {
      with_bool(*group.nesterov, [&](auto nesterov) {
        with_bool(state.step == 1, [&](auto first) {
          with_bool(c.grad_scale != 1.f, [&](auto scaled) {
            sgd_kernel<decltype(decay)::value, decltype(mom)::value, decltype(nesterov)::value,
                       decltype(first)::value, decltype(scaled)::value>(p, g, buf, n, c);
          });
        });
      });
    });
  });
}

}  // namespace acc::optim
