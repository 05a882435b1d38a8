#include "acc/nn/module.hpp"

#include <cxxabi.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "acc/tensor/node.hpp"
#include "acc/tensor/observer.hpp"
#include "acc/util/error.hpp"

namespace acc::nn {
namespace {

std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

bool contains_same(const NamedTensors& list, const Tensor& t) {
  return std::any_of(list.begin(), list.end(), [&](const auto& p) { return p.second.is_same(t); });
}

}  // namespace

namespace {
thread_local ForwardOptions current_options;
}  // namespace

const ForwardOptions& current_forward_options() {
  return current_options;
}

ForwardOptionsGuard::ForwardOptionsGuard(const ForwardOptions& options)
    : previous_(current_options) {
  current_options = options;
}

ForwardOptionsGuard::~ForwardOptionsGuard() {
  current_options = previous_;
}

std::string detail::demangled_type_name(const std::type_info& type) {
  int status = 0;
  char* name = abi::__cxa_demangle(type.name(), nullptr, nullptr, &status);
  std::string out = status == 0 && name != nullptr ? name : type.name();
  std::free(name);
  return out;
}

Module::Module(std::string type_name) : type_name_(std::move(type_name)) {}

Module::~Module() {
  for (auto& slot : children_) {
    // An undo of replace_module that outlives the model finds no owner and does nothing.
    slot->owner = nullptr;
    if (slot->module && slot->module->parent_ == this) slot->module->parent_ = nullptr;
  }
}

void Module::check_new_name(const std::string& name, const char* what) const {
  ACC_CHECK(!name.empty(), type_name_, ": ", what, " name must not be empty");
  ACC_CHECK(name.find('.') == std::string::npos, type_name_, ": ", what, " name '", name,
            "' must not contain '.'");
  auto taken = [&](const auto& list) {
    return std::any_of(list.begin(), list.end(), [&](const auto& p) { return p.first == name; });
  };
  ACC_CHECK(!taken(parameters_) && !taken(buffers_) && find_slot(name) == nullptr, type_name_, ": ",
            what, " name '", name, "' is already registered");
}

Tensor& Module::register_parameter(const std::string& name, Tensor t, bool requires_grad) {
  check_new_name(name, "parameter");
  ACC_CHECK(t.defined(), type_name_, ": parameter '", name, "' is undefined");
  if (requires_grad && !t.requires_grad()) t.set_requires_grad(true);
  parameters_.emplace_back(name, std::move(t));
  return parameters_.back().second;
}

Tensor& Module::register_buffer(const std::string& name, Tensor t, bool persistent) {
  check_new_name(name, "buffer");
  ACC_CHECK(t.defined(), type_name_, ": buffer '", name, "' is undefined");
  buffers_.emplace_back(name, std::move(t));
  buffer_persistent_.push_back(persistent);
  return buffers_.back().second;
}

std::shared_ptr<detail::ChildSlot> Module::register_child(const std::string& name, ModulePtr m) {
  check_new_name(name, "module");
  ACC_CHECK(m != nullptr, type_name_, ": module '", name, "' is null");
  if (m->parent_ == nullptr) {
    m->parent_ = this;
    m->local_name_ = name;
  }
  children_.push_back(
      std::make_shared<detail::ChildSlot>(detail::ChildSlot{name, std::move(m), this}));
  return children_.back();
}

const detail::ChildSlot* Module::find_slot(const std::string& name) const {
  for (const auto& slot : children_) {
    if (slot->name == name) return slot.get();
  }
  return nullptr;
}

void Module::collect_parameters(const std::string& prefix, NamedTensors& out) const {
  for (const auto& [name, t] : parameters_) {
    if (!contains_same(out, t)) out.emplace_back(join(prefix, name), t);
  }
}

void Module::collect_buffers(const std::string& prefix, bool persistent_only,
                             NamedTensors& out) const {
  for (size_t i = 0; i < buffers_.size(); ++i) {
    if (persistent_only && !buffer_persistent_[i]) continue;
    out.emplace_back(join(prefix, buffers_[i].first), buffers_[i].second);
  }
}

void Module::collect_modules(const std::string& prefix, NamedModules& out) const {
  for (const auto& slot : children_) {
    std::string full = join(prefix, slot->name);
    out.emplace_back(full, slot->module);
    slot->module->collect_modules(full, out);
  }
}

namespace {
// A handle to `m`: shared when m is owned by a shared_ptr, else non-owning (a module on the stack).
ModulePtr handle(const Module* m) {
  ModulePtr p = std::const_pointer_cast<Module>(m->weak_from_this().lock());
  return p ? p : ModulePtr(ModulePtr(), const_cast<Module*>(m));
}
}  // namespace

NamedModules Module::named_modules() const {
  NamedModules out;
  out.emplace_back("", handle(this));
  collect_modules("", out);
  return out;
}

NamedModules Module::named_children() const {
  NamedModules out;
  for (const auto& slot : children_) out.emplace_back(slot->name, slot->module);
  return out;
}

NamedTensors Module::named_parameters(bool recurse) const {
  NamedTensors out;
  collect_parameters("", out);
  if (recurse) {
    NamedModules mods;
    collect_modules("", mods);
    for (const auto& [name, m] : mods) m->collect_parameters(name, out);
  }
  return out;
}

void Module::collect_parameter_tensors(bool recurse, std::vector<Tensor>& out) const {
  for (const auto& named : parameters_) {
    const Tensor& t = named.second;  // named, not bound: clang refuses to capture a binding
    if (std::none_of(out.begin(), out.end(), [&](const Tensor& o) { return o.is_same(t); })) {
      out.push_back(t);
    }
  }
  if (!recurse) return;
  for (const auto& slot : children_) slot->module->collect_parameter_tensors(true, out);
}

// named_parameters()'s tensors in its order (the module's own, then its modules' in pre-order,
// each tied tensor once), without the names: the tracer asks this of every module it traces and
// of every block it compares, and building the dotted names was most of it.
std::vector<Tensor> Module::parameters(bool recurse) const {
  std::vector<Tensor> out;
  collect_parameter_tensors(recurse, out);
  return out;
}

NamedTensors Module::named_buffers(bool recurse) const {
  NamedTensors out;
  collect_buffers("", false, out);
  if (recurse) {
    NamedModules mods;
    collect_modules("", mods);
    for (const auto& [name, m] : mods) m->collect_buffers(name, false, out);
  }
  return out;
}

namespace {
// "0, 1, 2": the names of a module's children, for messages about a path that is not there.
std::string child_names(const std::vector<std::shared_ptr<detail::ChildSlot>>& children) {
  std::string out;
  for (const auto& s : children) out += (out.empty() ? "" : ", ") + s->name;
  return out;
}
}  // namespace

Undo undo_all(std::vector<Undo> undos) {
  return [undos = std::move(undos)]() mutable {
    for (auto it = undos.rbegin(); it != undos.rend(); ++it) {
      if (*it) (*it)();
    }
    undos.clear();
  };
}

ModulePtr Module::submodule(const std::string& path) const {
  ModulePtr cur = handle(this);
  size_t start = 0;
  while (start <= path.size() && !path.empty()) {
    size_t dot = path.find('.', start);
    std::string part =
        path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    const detail::ChildSlot* slot = cur->find_slot(part);
    if (slot == nullptr) {
      const std::string have = child_names(cur->children_);
      ACC_THROW(
          ValueError, type_name_, ": no submodule '", part, "' in path '", path,
          "': ", start == 0 ? std::string("the model") : "'" + path.substr(0, start - 1) + "'",
          " has no '", part, "' (it has ", have.empty() ? std::string("no children") : have, ")");
    }
    cur = slot->module;
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return cur;
}

namespace {
// What one replace_module() changed, for its undo.
struct Replacement {
  std::shared_ptr<detail::ChildSlot> slot;
  ModulePtr replaced, replacement;
  std::string path;
  bool done = false;
};
}  // namespace

// The tree keeps one parent pointer per module (the first registration wins), from which scopes
// and qualified names are read. A replacement takes the slot's name under the slot's owner; the
// replaced module leaves it, and when the replacement holds it (a wrapper) it is re-parented
// there. The undo walks the same steps back.
Undo Module::replace_module(const std::string& path, ModulePtr replacement) {
  ACC_CHECK(!path.empty(), type_name_,
            ": replace_module: the name is empty, which names this module itself; a root has no "
            "parent slot to be replaced in (give the dotted name of a child)");
  ACC_CHECK(replacement != nullptr, type_name_, ": replace_module('", path,
            "'): the replacement is null");
  // Walk to the slot, keeping the modules on the path (the replacement must not contain them).
  std::vector<const Module*> on_path{this};
  Module* owner = this;
  std::shared_ptr<detail::ChildSlot> slot;
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    const std::string part =
        path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    ACC_CHECK(!part.empty(), type_name_, ": replace_module('", path,
              "'): the name has an empty component");
    auto it = std::find_if(owner->children_.begin(), owner->children_.end(),
                           [&](const auto& s) { return s->name == part; });
    if (it == owner->children_.end()) {
      const std::string have = child_names(owner->children_);
      const std::string where = path.substr(0, start == 0 ? 0 : start - 1);
      ACC_THROW(ValueError, type_name_, ": replace_module('", path, "'): no child '", part, "' in ",
                where.empty() ? std::string("the root") : "'" + where + "'", " (",
                have.empty() ? std::string("it has no children") : "children: " + have, ")");
    }
    if (dot == std::string::npos) {
      slot = *it;
      break;
    }
    owner = (*it)->module.get();
    on_path.push_back(owner);
    start = dot + 1;
  }
  for (const auto& [name, m] : replacement->named_modules()) {
    const bool cycle = std::find(on_path.begin(), on_path.end(), m.get()) != on_path.end();
    ACC_CHECK(!cycle, type_name_, ": replace_module('", path, "'): the replacement ",
              replacement->type_name(), " is or contains ", m->type_name(), " '",
              m->qualified_name(),
              "', which is on the path to the slot; the tree would contain itself");
  }

  auto r = std::make_shared<Replacement>();
  r->slot = slot;
  r->replaced = slot->module;
  r->replacement = replacement;
  r->path = path;
  Module* old_m = r->replaced.get();
  // Parent pointers this call set, restored by the undo: (module, its parent and name before).
  struct Reparent {
    Module* module;
    const Module* parent;
    std::string name;
  };
  auto changed = std::make_shared<std::vector<Reparent>>();
  auto set_parent = [&](Module* m, const Module* parent, const std::string& name) {
    changed->push_back({m, m->parent_, m->local_name_});
    m->parent_ = parent;
    m->local_name_ = name;
  };
  if (old_m != replacement.get()) {
    if (old_m->parent_ == owner && old_m->local_name_ == slot->name) {
      set_parent(old_m, nullptr, "");
    }
    if (replacement->parent_ == nullptr) set_parent(replacement.get(), owner, slot->name);
    slot->module = replacement;
    // Modules inside the replacement left without a parent (the replaced one, when the
    // replacement wraps it) take the one that holds them.
    for (const auto& [name, m] : replacement->named_modules()) {
      for (const auto& child : m->children_) {
        if (child->module->parent_ == nullptr)
          set_parent(child->module.get(), m.get(), child->name);
      }
    }
  }
  return [r, changed] {
    if (r->done) return;
    r->done = true;
    if (r->slot->owner == nullptr) return;  // the model is gone
    if (r->slot->module != r->replacement) {
      r->done = false;
      ACC_THROW(ValueError, "replace_module undo: '", r->path, "' holds ",
                r->slot->module->type_name(), ", not the ", r->replacement->type_name(),
                " this replacement put there; undo the later replacement first");
    }
    r->slot->module = r->replaced;
    for (auto it = changed->rbegin(); it != changed->rend(); ++it) {
      it->module->parent_ = it->parent;
      it->module->local_name_ = it->name;
    }
    changed->clear();
  };
}

Tensor Module::find_tensor(const std::string& path) const {
  const size_t dot = path.rfind('.');
  const Module* owner = this;
  ModulePtr holder;
  std::string leaf = path;
  if (dot != std::string::npos) {
    holder = submodule(path.substr(0, dot));
    owner = holder.get();
    leaf = path.substr(dot + 1);
  }
  for (const auto& list : {&owner->parameters_, &owner->buffers_}) {
    for (const auto& [name, t] : *list) {
      if (name == leaf) return t;
    }
  }
  ACC_THROW(ValueError, type_name_, ": no parameter or buffer '", path, "'");
}

Tensor& Module::local_tensor(const std::string& name) {
  for (auto* list : {&parameters_, &buffers_}) {
    for (auto& [n, t] : *list) {
      if (n == name) return t;
    }
  }
  ACC_THROW(ValueError, type_name_, ": no parameter or buffer '", name, "'");
}

int64_t Module::num_parameters() const {
  int64_t n = 0;
  for (const Tensor& t : parameters()) n += t.numel();
  return n;
}

std::string Module::qualified_name() const {
  std::string name;
  for (const Module* m = this; m->parent_ != nullptr; m = m->parent_) {
    name = name.empty() ? m->local_name_ : m->local_name_ + "." + name;
  }
  return name;
}

void Module::train(bool on) {
  training_ = on;
  for (auto& slot : children_) slot->module->train(on);
}

NamedTensors Module::state_dict() const {
  NamedTensors out;
  collect_parameters("", out);
  collect_buffers("", true, out);
  NamedModules mods;
  collect_modules("", mods);
  for (const auto& [name, m] : mods) {
    m->collect_parameters(name, out);
    m->collect_buffers(name, true, out);
  }
  return out;
}

void Module::load_state_dict(const NamedTensors& state, bool strict) {
  NamedTensors own = state_dict();
  std::vector<std::string> missing, unexpected;
  std::vector<std::pair<Tensor, Tensor>> copies;  // (destination, source)
  for (const auto& [name, dst] : own) {
    auto it = std::find_if(state.begin(), state.end(),
                           [&n = name](const auto& p) { return p.first == n; });
    if (it == state.end()) {
      missing.push_back(name);
      continue;
    }
    const Tensor& src = it->second;
    ACC_CHECK(src.defined(), "load_state_dict: entry '", name, "' is undefined");
    ACC_CHECK_SHAPE(src.shape() == dst.shape(), "load_state_dict: '", name, "' has shape ",
                    src.shape(), " in the state dict but ", dst.shape(), " in the model");
    ACC_CHECK_TYPE(
        src.dtype() == dst.dtype() || (is_floating(src.dtype()) && is_floating(dst.dtype())),
        "load_state_dict: '", name, "' has dtype ", src.dtype(), " in the state dict but ",
        dst.dtype(), " in the model");
    copies.emplace_back(dst, src);
  }
  for (const auto& [name, src] : state) {
    bool known =
        std::any_of(own.begin(), own.end(), [&n = name](const auto& p) { return p.first == n; });
    if (!known) unexpected.push_back(name);
  }
  if (strict && (!missing.empty() || !unexpected.empty())) {
    std::string msg = "load_state_dict: ";
    auto list = [](const std::vector<std::string>& v) {
      std::string s;
      for (size_t i = 0; i < v.size() && i < 8; ++i) s += (i ? ", " : "") + v[i];
      if (v.size() > 8) s += ", ... (" + std::to_string(v.size()) + " in all)";
      return s;
    };
    if (!missing.empty()) msg += "missing keys: " + list(missing);
    if (!unexpected.empty())
      msg += std::string(missing.empty() ? "" : "; ") + "unexpected keys: " + list(unexpected);
    throw ValueError(msg);
  }
  NoGradGuard ng;
  for (auto& [dst, src] : copies) dst.copy_(src);
}

void Module::zero_grad(bool set_to_none) {
  NoGradGuard ng;
  for (auto& [name, p] : named_parameters()) {
    if (set_to_none) {
      p.set_grad(Tensor());
    } else if (p.grad().defined()) {
      p.grad().zero_();
    }
  }
}

Tensor Module::forward(const Tensor&) {
  ACC_THROW(ValueError, type_name_, " '", qualified_name(),
            "' does not implement forward(Tensor); call its own methods");
}

Tensor Module::operator()(const Tensor& x) {
  Scope s(*this);
  for (auto& [id, hook] : pre_hooks_) hook(*this, x);
  // The wrapper may keep `fwd` and call it after this call has returned (acc::recompute replays
  // it in backward): it carries this call's forward options, so the replay computes what the
  // first run did (the same positions of a sequence shard).
  // A sequence chunk current when `fwd` runs is kept: a wrapper that runs the forward on a chunk
  // of the sequence (Megatron sequence parallelism) installs it around its call of fwd, also when
  // an outer wrapper replays it.
  Tensor out = wrapper_ ? wrapper_(*this, x,
                                   [this, options = current_forward_options()](const Tensor& in) {
                                     ForwardOptions o = options;
                                     const ForwardOptions& now = current_forward_options();
                                     if (now.sequence_chunk.active()) {
                                       o.sequence_chunk = now.sequence_chunk;
                                     }
                                     ForwardOptionsGuard guard(o);
                                     return forward(in);
                                   })
                        : forward(x);
  for (auto& [id, hook] : hooks_) hook(*this, x, out);
  return out;
}

int Module::register_forward_pre_hook(ForwardPreHook hook) {
  pre_hooks_.emplace_back(next_hook_id_, std::move(hook));
  return next_hook_id_++;
}

int Module::register_forward_hook(ForwardHook hook) {
  hooks_.emplace_back(next_hook_id_, std::move(hook));
  return next_hook_id_++;
}

void Module::remove_hook(int id) {
  std::erase_if(pre_hooks_, [id](const auto& p) { return p.first == id; });
  std::erase_if(hooks_, [id](const auto& p) { return p.first == id; });
}

Module::Scope::Scope(const Module& m) {
  acc::detail::push_scope(m.qualified_name());
}
Module::Scope::~Scope() {
  acc::detail::pop_scope();
}

std::string Module::current_scope() {
  return acc::detail::current_scope();
}

const ModulePtr& ModuleList::operator[](size_t i) const {
  ACC_CHECK(i < size(), "ModuleList: index ", i, " out of range for ", size(), " modules");
  return child_at(i);
}

Tensor ModuleList::forward(const Tensor& x) {
  Tensor h = x;
  for (const ModulePtr& m : *this) h = (*m)(h);
  return h;
}

std::string describe_non_finite(const NamedTensors& tensors) {
  for (const auto& [name, t] : tensors) {
    if (!t.defined() || t.is_meta() ||
        (t.dtype() != DType::kFloat32 && t.dtype() != DType::kBFloat16)) {
      continue;
    }
    const std::vector<float> v = t.to_vector<float>();
    int64_t bad = 0, first = -1;
    for (size_t i = 0; i < v.size(); ++i) {
      if (!std::isfinite(v[i])) {
        if (first < 0) first = static_cast<int64_t>(i);
        ++bad;
      }
    }
    if (bad > 0) {
      return ::acc::detail::str_cat(name, " holds ", bad, " non-finite value(s) of ", v.size(),
                                    ", the first ", v[static_cast<size_t>(first)], " at index ",
                                    first);
    }
  }
  return {};
}

}  // namespace acc::nn
