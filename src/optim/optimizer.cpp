#include "acc/optim/optimizer.hpp"

#include <algorithm>
#include <unordered_set>

#include "acc/tensor/node.hpp"
#include "acc/util/error.hpp"
#include "optim_util.hpp"

namespace acc::optim {

namespace {

constexpr const char* kStatePrefix = "state.";
constexpr const char* kStepField = "step";

std::string state_key(const std::string& param, const std::string& field) {
  return kStatePrefix + param + "." + field;
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out.empty() ? "nothing" : out;
}

}  // namespace

ParamGrouping decay_matrices_only() {
  return [](NamedParams params) {
    ParamGroup decay, no_decay;
    no_decay.weight_decay = 0.0;
    for (auto& [name, p] : params) {
      (p.defined() && p.dim() >= 2 ? decay : no_decay).params.emplace_back(name, p);
    }
    std::vector<ParamGroup> groups;
    if (!decay.params.empty()) groups.push_back(std::move(decay));
    if (!no_decay.params.empty()) groups.push_back(std::move(no_decay));
    return groups;
  };
}

OptimizerFactory::OptimizerFactory(Build build, ParamGrouping grouping)
    : build_(std::move(build)), grouping_(std::move(grouping)) {}

OptimizerFactory::OptimizerFactory(
    std::function<std::unique_ptr<Optimizer>(NamedParams)> from_params)
    : opaque_(std::move(from_params)) {}

std::unique_ptr<Optimizer> OptimizerFactory::operator()(NamedParams params) const {
  ACC_CHECK(static_cast<bool>(*this), "optimizer factory is empty");
  if (opaque_) return opaque_(std::move(params));
  return build(group(std::move(params)));
}

std::vector<ParamGroup> OptimizerFactory::group(NamedParams params) const {
  ACC_CHECK(build_ != nullptr,
            "optimizer factory: group() needs a factory made by SGD/Adam/AdamW::factory (this one "
            "is a plain function of the parameters)");
  if (!grouping_) return {ParamGroup{.params = std::move(params)}};
  return grouping_(std::move(params));
}

std::unique_ptr<Optimizer> OptimizerFactory::build(std::vector<ParamGroup> groups) const {
  ACC_CHECK(build_ != nullptr,
            "optimizer factory: build() needs a factory made by SGD/Adam/AdamW::factory (this one "
            "is a plain function of the parameters)");
  return build_(std::move(groups));
}

int optimizer_state_buffers(const OptimizerFactory& factory) {
  NamedParams probe = {{"probe.weight", zeros({2, 2}, {.requires_grad = true})},
                       {"probe.bias", zeros({2}, {.requires_grad = true})}};
  const std::unique_ptr<Optimizer> opt = factory(std::move(probe));
  ACC_CHECK(opt != nullptr, "optimizer factory returned no optimizer for the probe parameters");
  size_t most = 0;
  for (size_t g = 0; g < opt->param_groups().size(); ++g) {
    most = std::max(most, opt->buffers_per_parameter(g));
  }
  return static_cast<int>(most);
}

Optimizer::~Optimizer() = default;

size_t Optimizer::buffers_per_parameter(size_t group) const {
  ACC_CHECK(group < fields_.size(), name(), ": no param group ", group, " (it has ", fields_.size(),
            ")");
  return fields_[group].size();
}

void Optimizer::init(std::vector<ParamGroup> groups) {
  size_t total = 0;
  for (const auto& g : groups) total += g.params.size();
  ACC_CHECK(total > 0, name(), ": optimizer got an empty parameter list (", groups.size(),
            " param groups)");
  for (auto& g : groups) add_param_group(std::move(g));
}

void Optimizer::add_param_group(ParamGroup group) {
  const size_t gi = groups_.size();
  resolve_group(group, gi);
  const std::string who = name() + ": param group " + std::to_string(gi);

  std::unordered_set<std::string> names;
  // Identity check only (one tensor under two names would be updated twice); nothing is keyed by
  // it.
  std::unordered_set<const TensorImpl*> impls;
  for (const auto& st : states_) impls.insert(st.param.impl());
  for (const auto& [pname, p] : group.params) {
    ACC_CHECK(!pname.empty(), who, ": a parameter has an empty name");
    ACC_CHECK(index_.find(pname) == index_.end() && names.insert(pname).second, who,
              ": parameter '", pname, "' appears more than once");
    ACC_CHECK(p.defined(), who, ": parameter '", pname, "' is an undefined tensor");
    ACC_CHECK(impls.insert(p.impl()).second, who, ": parameter '", pname,
              "' is the same tensor as another parameter");
    ACC_CHECK_TYPE(p.dtype() == DType::kFloat32, who, ": parameter '", pname, "' must be f32, got ",
                   p.dtype());
    ACC_CHECK(p.is_contiguous(), who, ": parameter '", pname, "' must be contiguous, got shape ",
              p.shape(), " strides ", p.strides());
    ACC_CHECK(p.is_leaf(), who, ": parameter '", pname,
              "' is not a leaf (it was computed by an op); optimise the leaf it came from");
  }

  const std::vector<std::string> fields = buffer_names(group);
  std::vector<ParamState> fresh;
  fresh.reserve(group.params.size());
  for (const auto& [pname, p] : group.params) {
    ParamState st{pname, p, gi, 0, {}};
    for (size_t j = 0; j < fields.size(); ++j) st.buffers.push_back(zeros_like(p));
    fresh.push_back(std::move(st));
  }
  // Commit (nothing above changed the optimizer).
  for (auto& st : fresh) {
    index_.emplace(st.name, states_.size());
    states_.push_back(std::move(st));
  }
  groups_.push_back(std::move(group));
  fields_.push_back(fields);
}

void Optimizer::step() {
  step_scaled(1.0);
}

void Optimizer::step_scaled(double grad_scale) {
  ACC_CHECK(grad_scale >= 0.0, name(), ".step_scaled: grad_scale must be >= 0, got ", grad_scale);
  NoGradGuard no_grad;
  std::vector<std::pair<size_t, Tensor>> work;
  work.reserve(states_.size());
  for (size_t i = 0; i < states_.size(); ++i) {
    const ParamState& st = states_[i];
    Tensor g = st.param.grad();
    if (!g.defined()) continue;
    ACC_CHECK_TYPE(g.dtype() == DType::kFloat32, name(), ".step: gradient of '", st.name,
                   "' must be f32, got ", g.dtype());
    ACC_CHECK_SHAPE(g.shape() == st.param.shape(), name(), ".step: gradient of '", st.name,
                    "' has shape ", g.shape(), ", parameter has ", st.param.shape());
    ACC_CHECK_TYPE(g.device() == st.param.device(), name(), ".step: gradient of '", st.name,
                   "' is on ", g.device(), ", parameter on ", st.param.device());
    ACC_CHECK(g.is_contiguous(), name(), ".step: gradient of '", st.name,
              "' must be contiguous, got strides ", g.strides());
    work.emplace_back(i, std::move(g));
  }
  grad_scale_ = static_cast<float>(grad_scale);
  for (auto& [i, g] : work) {
    ParamState& st = states_[i];
    ++st.step;
    if (st.param.is_meta()) continue;
    update(groups_[st.group], st, g);
  }
  grad_scale_ = 1.f;
}

void Optimizer::zero_grad(bool set_to_none) {
  NoGradGuard no_grad;
  for (auto& st : states_) {
    Tensor g = st.param.grad();
    if (!g.defined()) continue;
    if (set_to_none) {
      st.param.set_grad(Tensor());
    } else {
      g.zero_();
    }
  }
}

double Optimizer::lr() const {
  return *groups_.front().lr;
}

void Optimizer::set_lr(double lr) {
  detail::check_non_negative(name() + ".set_lr", "lr", lr);
  for (auto& g : groups_) g.lr = lr;
}

void Optimizer::set_group_lr(size_t group, double lr) {
  ACC_CHECK(group < groups_.size(), name(), ".set_group_lr: group ", group, " out of range (",
            groups_.size(), " groups)");
  detail::check_non_negative(name() + ".set_group_lr", "lr", lr);
  groups_[group].lr = lr;
}

std::vector<std::string> Optimizer::param_names() const {
  std::vector<std::string> out;
  out.reserve(states_.size());
  for (const auto& st : states_) out.push_back(st.name);
  return out;
}

NamedParams Optimizer::named_parameters() const {
  NamedParams out;
  out.reserve(states_.size());
  for (const auto& st : states_) out.emplace_back(st.name, st.param);
  return out;
}

int64_t Optimizer::param_step(const std::string& pname) const {
  auto it = index_.find(pname);
  ACC_CHECK(it != index_.end(), name(), ".param_step: unknown parameter '", pname, "'");
  return states_[it->second].step;
}

StateDict Optimizer::state_dict() const {
  StateDict out;
  for (const auto& st : states_) {
    out.emplace_back(state_key(st.name, kStepField),
                     scalar_tensor(static_cast<double>(st.step), {.dtype = DType::kInt64}));
    const auto& fields = fields_[st.group];
    for (size_t j = 0; j < fields.size(); ++j) {
      out.emplace_back(state_key(st.name, fields[j]), st.buffers[j]);
    }
  }
  return out;
}

void Optimizer::load_state_dict(const StateDict& state) {
  const std::string who = name() + ".load_state_dict";
  std::vector<int64_t> steps(states_.size(), -1);
  std::vector<std::vector<const Tensor*>> bufs(states_.size());
  for (size_t i = 0; i < states_.size(); ++i) {
    bufs[i].assign(states_[i].buffers.size(), nullptr);
  }

  // Pass 1: check every entry; nothing changes until all are valid.
  std::unordered_set<std::string> seen;
  const std::string prefix = kStatePrefix;
  for (const auto& [key, t] : state) {
    ACC_CHECK(seen.insert(key).second, who, ": key '", key, "' appears more than once");
    const size_t dot = key.rfind('.');
    const bool well_formed =
        key.size() > prefix.size() && key.compare(0, prefix.size(), prefix) == 0 &&
        dot != std::string::npos && dot > prefix.size() && dot + 1 < key.size();
    ACC_CHECK(well_formed, who, ": unexpected key '", key,
              "' (expected state.<param name>.<field>)");
    const std::string pname = key.substr(prefix.size(), dot - prefix.size());
    const std::string field = key.substr(dot + 1);
    auto it = index_.find(pname);
    ACC_CHECK(it != index_.end(), who, ": unknown parameter '", pname, "' (key '", key,
              "'); the optimizer has ", states_.size(), " parameters");
    const size_t i = it->second;
    const ParamState& st = states_[i];
    ACC_CHECK(t.defined(), who, ": entry '", key, "' is an undefined tensor");

    if (field == kStepField) {
      ACC_CHECK_TYPE((t.dtype() == DType::kInt64 || t.dtype() == DType::kInt32) && !t.is_meta(),
                     who, ": step of parameter '", pname, "' must be an i64 scalar on cpu, got ",
                     t.dtype(), " on ", t.device());
      ACC_CHECK_SHAPE(t.numel() == 1, who, ": step of parameter '", pname,
                      "' must have one element, got shape ", t.shape());
      const double v = t.item();
      ACC_CHECK(v >= 0, who, ": step of parameter '", pname, "' must be >= 0, got ", v);
      steps[i] = static_cast<int64_t>(v);
      continue;
    }
    const auto& fields = fields_[st.group];
    size_t j = 0;
    while (j < fields.size() && fields[j] != field) ++j;
    ACC_CHECK(j < fields.size(), who, ": unknown state '", field, "' for parameter '", pname,
              "' (key '", key, "'); ", name(), " keeps step and ", join(fields),
              " for this parameter");
    ACC_CHECK_SHAPE(t.shape() == st.param.shape(), who, ": shape mismatch for parameter '", pname,
                    "' (", field, "): parameter has ", st.param.shape(), ", state dict has ",
                    t.shape());
    ACC_CHECK_TYPE(t.dtype() == DType::kFloat32 && t.device() == st.param.device(), who, ": ",
                   field, " of parameter '", pname, "' must be f32 on ", st.param.device(),
                   ", got ", t.dtype(), " on ", t.device());
    bufs[i][j] = &t;
  }
  for (size_t i = 0; i < states_.size(); ++i) {
    const ParamState& st = states_[i];
    ACC_CHECK(steps[i] >= 0, who, ": missing '", state_key(st.name, kStepField),
              "' for parameter '", st.name, "'");
    for (size_t j = 0; j < bufs[i].size(); ++j) {
      ACC_CHECK(bufs[i][j] != nullptr, who, ": missing '", state_key(st.name, fields_[st.group][j]),
                "' for parameter '", st.name, "'");
    }
  }

  // Pass 2: copy.
  NoGradGuard no_grad;
  for (size_t i = 0; i < states_.size(); ++i) {
    ParamState& st = states_[i];
    st.step = steps[i];
    for (size_t j = 0; j < bufs[i].size(); ++j) {
      if (!bufs[i][j]->is_same(st.buffers[j])) st.buffers[j].copy_(*bufs[i][j]);
    }
  }
}

}  // namespace acc::optim
