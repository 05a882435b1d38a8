#pragma once
// acc::nn::Module: the base of every layer and model, shaped like torch::nn::Module.
//
// Parameters, buffers and children are registered by name and kept in registration order;
// named_parameters() returns dotted paths ("transformer.h.3.attn.c_attn.weight") that are the
// identity of a parameter everywhere in AutoAcc: optimizer state, traces, strategies and
// checkpoints are all keyed by them, never by addresses.
//
// Calling a module through operator()(x) (instead of forward(x) directly) runs its forward hooks
// and wrappers and puts its dotted name on the scope stack, which is how a trace attributes ops
// to modules and how strategies (FSDP, recompute, pipeline stages) intercept blocks. Modules whose
// forward takes other arguments open `auto s = scope();` themselves.

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "acc/tensor/tensor.hpp"

namespace acc::nn {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

/// Describes the first floating tensor of `tensors` that holds a NaN or an infinity ("<name> holds
/// 3 non-finite value(s) of 64, the first nan at index 17"); empty when every value is finite.
/// Loading weights checks this, so that a NaN loss later can say where it came from.
std::string describe_non_finite(const NamedTensors& tensors);

class Module;
using ModulePtr = std::shared_ptr<Module>;
using NamedModules = std::vector<std::pair<std::string, ModulePtr>>;

class Module : public std::enable_shared_from_this<Module> {
 public:
  explicit Module(std::string type_name = "Module");
  virtual ~Module();
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  /// The class name shown in traces and errors ("Linear", "GPTBlock", ...).
  const std::string& type_name() const { return type_name_; }

  // ---- registration ----
  /// Registers `t` as a parameter under `name` (no dots, unique among this module's parameters,
  /// buffers and children); marks it requires_grad unless told otherwise. Returns the stored
  /// handle. Throws acc::ValueError for a bad or duplicate name or an undefined tensor.
  Tensor& register_parameter(const std::string& name, Tensor t, bool requires_grad = true);
  /// Registers a buffer (state that is not trained); `persistent` buffers are in state_dict().
  Tensor& register_buffer(const std::string& name, Tensor t, bool persistent = true);
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> m) {
    register_child(name, m);
    return m;
  }

  // ---- lookup ----
  /// Parameters of this module and (recurse) its descendants, dotted names, registration order.
  /// A tensor registered under two names is listed once, under the first.
  NamedTensors named_parameters(bool recurse = true) const;
  std::vector<Tensor> parameters(bool recurse = true) const;
  NamedTensors named_buffers(bool recurse = true) const;
  /// This module (name "") and every descendant, pre-order.
  NamedModules named_modules() const;
  NamedModules named_children() const;
  /// The descendant at a dotted path ("transformer.h.3"); throws acc::ValueError naming the
  /// first missing component.
  ModulePtr submodule(const std::string& path) const;
  /// A parameter or buffer by dotted path; throws acc::ValueError when there is none.
  Tensor find_tensor(const std::string& path) const;
  int64_t num_parameters() const;

  /// Dotted path of this module from the root it was registered into ("" for a root).
  std::string qualified_name() const;

  // ---- mode ----
  virtual void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // ---- state ----
  /// Parameters and persistent buffers by dotted name (sharing data with the module).
  NamedTensors state_dict() const;
  /// Copies values by name. Throws acc::ShapeError / acc::TypeError naming the entry on a shape or
  /// dtype mismatch, and (strict) acc::ValueError listing missing and unexpected names. Nothing
  /// is modified unless every entry checks out.
  void load_state_dict(const NamedTensors& state, bool strict = true);
  void zero_grad(bool set_to_none = true);

  // ---- calling ----
  /// The module's computation on one tensor. The default throws acc::ValueError: modules with a
  /// different signature define their own methods.
  virtual Tensor forward(const Tensor& x);
  /// forward(x) with this module's scope open, forward pre-hooks, the wrapper (if any) and forward
  /// hooks applied.
  Tensor operator()(const Tensor& x);

  using ForwardPreHook = std::function<void(Module&, const Tensor& input)>;
  using ForwardHook = std::function<void(Module&, const Tensor& input, const Tensor& output)>;
  /// Replaces the call of forward: wrapper(module, x, forward) must return the output. Used by
  /// strategies such as activation recomputation.
  using ForwardWrapper =
      std::function<Tensor(Module&, const Tensor&, const std::function<Tensor(const Tensor&)>&)>;
  /// Hooks run in registration order; the returned id removes them.
  int register_forward_pre_hook(ForwardPreHook hook);
  int register_forward_hook(ForwardHook hook);
  void set_forward_wrapper(ForwardWrapper wrapper) { wrapper_ = std::move(wrapper); }
  bool has_forward_wrapper() const { return static_cast<bool>(wrapper_); }
  const ForwardWrapper& forward_wrapper() const { return wrapper_; }
  void remove_hook(int id);
  /// Forward pre-hooks and forward hooks registered on this module (not its children).
  size_t num_forward_hooks() const { return pre_hooks_.size() + hooks_.size(); }

  /// RAII: while alive, this module's dotted name is the current scope of this thread.
  class Scope {
   public:
    explicit Scope(const Module& m);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
  };
  Scope scope() const { return Scope(*this); }
  /// The dotted name of the innermost module being called in this thread ("" outside any).
  static std::string current_scope();

 protected:
  /// The local parameter/buffer registered under `name`; throws acc::ValueError naming it.
  Tensor& local_tensor(const std::string& name);

 private:
  void register_child(const std::string& name, ModulePtr m);
  void check_new_name(const std::string& name, const char* what) const;
  void collect_parameters(const std::string& prefix, NamedTensors& out) const;
  void collect_buffers(const std::string& prefix, bool persistent_only, NamedTensors& out) const;
  void collect_modules(const std::string& prefix, NamedModules& out) const;

  std::string type_name_;
  NamedTensors parameters_;
  NamedTensors buffers_;
  std::vector<bool> buffer_persistent_;
  NamedModules children_;
  const Module* parent_ = nullptr;  // non-owning; cleared when the parent goes away
  std::string local_name_;
  bool training_ = true;
  int next_hook_id_ = 0;
  std::vector<std::pair<int, ForwardPreHook>> pre_hooks_;
  std::vector<std::pair<int, ForwardHook>> hooks_;
  ForwardWrapper wrapper_;
};

/// Children "0", "1", ... called in order; forward(x) chains them.
class ModuleList : public Module {
 public:
  ModuleList() : Module("ModuleList") {}
  template <class M>
  std::shared_ptr<M> push_back(std::shared_ptr<M> m) {
    modules_.push_back(m);
    return register_module(std::to_string(modules_.size() - 1), std::move(m));
  }
  size_t size() const { return modules_.size(); }
  const ModulePtr& operator[](size_t i) const;
  auto begin() const { return modules_.begin(); }
  auto end() const { return modules_.end(); }
  Tensor forward(const Tensor& x) override;

 private:
  std::vector<ModulePtr> modules_;
};

}  // namespace acc::nn
