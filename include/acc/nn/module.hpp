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
//
// A parent holds its children as nn::Child<M>, a typed handle on the registry's slot rather than
// on the module in it, and calls them through it: replace_module() changes the slot, and from then
// on forward runs the replacement, named_parameters()/state_dict() list its tensors under the same
// path, and hooks, wrappers and scopes are the replacement's. (A parent that keeps a shared_ptr of
// its own goes on calling the module it registered.)

#include <cstddef>
#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "acc/tensor/random.hpp"
#include "acc/tensor/tensor.hpp"
#include "acc/util/error.hpp"

namespace acc::nn {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

/// Describes the first floating tensor of `tensors` that holds a NaN or an infinity ("<name> holds
/// 3 non-finite value(s) of 64, the first nan at index 17"); empty when every value is finite.
/// Loading weights checks this, so that a NaN loss later can say where it came from.
std::string describe_non_finite(const NamedTensors& tensors);

class Module;
using ModulePtr = std::shared_ptr<Module>;
using NamedModules = std::vector<std::pair<std::string, ModulePtr>>;

/// Restores what a model transform changed (wrap_forward, recompute_blocks, replace_module, the
/// strategy methods' transforms) when called: once, later calls do nothing. Undo in the reverse
/// order of the transforms: a later one may hold what the earlier one put in place. Dropping an
/// Undo without calling it leaves the transform in place.
using Undo = std::function<void()>;
/// Several undos as one: runs them in reverse order (the last transform first), once; empty ones
/// are skipped.
Undo undo_all(std::vector<Undo> undos);

/// Options of one forward call that modules deep inside it read, without every block's
/// operator()(x) taking arguments (strategies wrap blocks as Tensor -> Tensor functions).
/// LanguageModel::forward(idx, options) installs them; modules read current_forward_options().
struct ForwardOptions {
  /// Position in its sequence of the first token of the input: the input is the chunk [k, k + T)
  /// of a longer sequence (a sequence shard), so learned positions (GPT wpe) and rotary positions
  /// (Llama RoPE) are those of tokens k ... k + T - 1. 0, the default, is a whole sequence.
  int64_t position_offset = 0;
  /// Sequence parallelism: the activations of this forward are a chunk of the whole sequence's
  /// (TensorChunk along the sequence dimension): Dropout draws each element's mask from its index
  /// in the whole, as one process does. Inactive (full 0) by default.
  TensorChunk sequence_chunk = {};
};

/// The options of the innermost ForwardOptionsGuard of this thread (the defaults outside any).
const ForwardOptions& current_forward_options();

/// RAII: while alive, `options` are current_forward_options() in this thread (the previous ones
/// come back when it goes). Module::operator() hands a forward wrapper a forward that re-installs
/// the options of its call, so a block recomputed in backward (acc::recompute) replays with the
/// options it first ran with, whichever guard is current then.
class ForwardOptionsGuard {
 public:
  explicit ForwardOptionsGuard(const ForwardOptions& options);
  ~ForwardOptionsGuard();
  ForwardOptionsGuard(const ForwardOptionsGuard&) = delete;
  ForwardOptionsGuard& operator=(const ForwardOptionsGuard&) = delete;

 private:
  ForwardOptions previous_;
};

namespace detail {
/// One entry of a module's registry of children. Shared: a parent's Child<M> and the undo of a
/// replace_module() refer to the slot, not to the module in it.
struct ChildSlot {
  std::string name;
  ModulePtr module;
  Module* owner = nullptr;  // the module whose child this is; cleared when it goes
};
/// "acc::nn::Linear" for typeid(Linear): the type a Child<M> expects, in its errors.
std::string demangled_type_name(const std::type_info& type);
}  // namespace detail

template <class M>
class Child;

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
  /// Registers `m` as the child `name` (rules as register_parameter; a null module is an
  /// acc::ValueError). Returns the typed handle on its slot, which sees a later replace_module();
  /// it converts to std::shared_ptr<M> (the module registered now) for code that keeps its own.
  template <class M>
  Child<M> register_module(const std::string& name, std::shared_ptr<M> m);

  // ---- replacing ----
  /// Puts `replacement` where the child at dotted `path` ("transformer.h.0.attn.c_attn", relative
  /// to this module) is: same name and position among its siblings, so forward (through the
  /// parent's Child<M>), named_parameters(), state_dict() and trace scopes see the replacement
  /// under that path. The replaced module's hooks and wrapper stay with it, unused while it is
  /// out; the replacement's own apply. The replacement may hold the replaced module as a child of
  /// its own (a wrapper): it then sits under the replacement's path ("...c_attn.inner").
  /// Returns the undo, which puts the replaced module back and leaves the tree exactly as it was
  /// (names, parents, order); it does nothing once the model is gone, and throws acc::ValueError
  /// when a later replacement of the same slot has not been undone first.
  /// Throws acc::ValueError naming the problem for an empty path (this module itself: a root
  /// has no parent slot to be replaced in), an empty component, a path that names no child (the
  /// first missing component and the children there are listed), a null replacement, and a
  /// replacement that is or contains this module or a module on the path (the tree would contain
  /// itself). A replacement that is not an nn::Module does not compile.
  Undo replace_module(const std::string& path, ModulePtr replacement);

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
  /// first missing component and the children where it is missing.
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
  /// The module in the i-th child slot now, in registration order (what ModuleList iterates).
  size_t num_children() const { return children_.size(); }
  const ModulePtr& child_at(size_t i) const { return children_.at(i)->module; }

 private:
  std::shared_ptr<detail::ChildSlot> register_child(const std::string& name, ModulePtr m);
  const detail::ChildSlot* find_slot(const std::string& name) const;
  void check_new_name(const std::string& name, const char* what) const;
  void collect_parameters(const std::string& prefix, NamedTensors& out) const;
  void collect_parameter_tensors(bool recurse, std::vector<Tensor>& out) const;  // no names
  void collect_buffers(const std::string& prefix, bool persistent_only, NamedTensors& out) const;
  void collect_modules(const std::string& prefix, NamedModules& out) const;

  std::string type_name_;
  NamedTensors parameters_;
  NamedTensors buffers_;
  std::vector<bool> buffer_persistent_;
  std::vector<std::shared_ptr<detail::ChildSlot>> children_;
  const Module* parent_ = nullptr;  // non-owning; cleared when the parent goes away
  std::string local_name_;
  bool training_ = true;
  int next_hook_id_ = 0;
  std::vector<std::pair<int, ForwardPreHook>> pre_hooks_;
  std::vector<std::pair<int, ForwardHook>> hooks_;
  ForwardWrapper wrapper_;
};

/// A typed handle on a child slot of a module: what a parent keeps of its children and calls them
/// through. operator() and get() use whatever module the slot holds now (see replace_module);
/// operator-> and operator* also require it to be an M (a replacement of another type is an
/// acc::TypeError naming the path and both types). Empty until assigned from register_module().
template <class M>
class Child {
 public:
  Child() = default;
  /// A handle on the same slot that expects a base of what `other` expects (implicit, as
  /// shared_ptr<Derived> converts to shared_ptr<Base>).
  template <class D>
  requires std::is_base_of_v<M, D> Child(const Child<D>& other) : slot_(other.slot_) {}

  /// Calls the module in the slot through Module::operator() (hooks, wrapper, scope).
  Tensor operator()(const Tensor& x) const { return (*get())(x); }
  /// The module in the slot now, whatever its type.
  const ModulePtr& get() const;
  /// The module in the slot now as an M; throws acc::TypeError when it is not one.
  M& operator*() const { return *typed(); }
  M* operator->() const { return typed().get(); }
  std::shared_ptr<M> typed() const;
  /// Implicit, so that code keeping a std::shared_ptr<M> of what it registers compiles as before
  /// (it then holds that module, not the slot).
  operator std::shared_ptr<M>() const { return typed(); }
  /// False for an empty handle (an optional child that was not registered).
  explicit operator bool() const { return slot_ != nullptr; }

 private:
  friend class Module;
  template <class>
  friend class Child;
  explicit Child(std::shared_ptr<detail::ChildSlot> slot) : slot_(std::move(slot)) {}
  std::shared_ptr<detail::ChildSlot> slot_;
};

template <class M>
Child<M> Module::register_module(const std::string& name, std::shared_ptr<M> m) {
  static_assert(std::is_base_of_v<Module, M>, "register_module takes an nn::Module");
  return Child<M>(register_child(name, std::move(m)));
}

template <class M>
const ModulePtr& Child<M>::get() const {
  ACC_CHECK(slot_ != nullptr, "nn::Child<", detail::demangled_type_name(typeid(M)),
            ">: the handle is empty (assign it from register_module)");
  return slot_->module;
}

template <class M>
std::shared_ptr<M> Child<M>::typed() const {
  const ModulePtr& m = get();
  auto p = std::dynamic_pointer_cast<M>(m);
  ACC_CHECK_TYPE(p != nullptr, "module '", m->qualified_name(), "' is a ", m->type_name(),
                 " (replaced), not the ", detail::demangled_type_name(typeid(M)),
                 " its parent expects; call it through the parent's Child (operator()) or "
                 "replace it with a subclass");
  return p;
}

/// Children "0", "1", ... called in order; forward(x) chains them. Iterating, indexing and size()
/// read the registry, so a replaced entry (replace_module("3", ...)) is the one they give.
class ModuleList : public Module {
 public:
  ModuleList() : Module("ModuleList") {}
  template <class M>
  Child<M> push_back(std::shared_ptr<M> m) {
    return register_module(std::to_string(size()), std::move(m));
  }
  size_t size() const { return num_children(); }
  /// Throws acc::ValueError for an index out of range.
  const ModulePtr& operator[](size_t i) const;

  /// Iterates the modules in the slots, in order.
  class Iterator {
   public:
    using iterator_category = std::forward_iterator_tag;
    using value_type = ModulePtr;
    using difference_type = std::ptrdiff_t;
    using pointer = const ModulePtr*;
    using reference = const ModulePtr&;
    Iterator() = default;
    Iterator(const ModuleList* list, size_t i) : list_(list), i_(i) {}
    reference operator*() const { return list_->child_at(i_); }
    pointer operator->() const { return &list_->child_at(i_); }
    Iterator& operator++() {
      ++i_;
      return *this;
    }
    Iterator operator++(int) {
      Iterator before = *this;
      ++i_;
      return before;
    }
    bool operator==(const Iterator& o) const { return list_ == o.list_ && i_ == o.i_; }

   private:
    const ModuleList* list_ = nullptr;
    size_t i_ = 0;
  };
  Iterator begin() const { return {this, 0}; }
  Iterator end() const { return {this, size()}; }
  Tensor forward(const Tensor& x) override;
};

}  // namespace acc::nn
