#pragma once
// acc::Tensor: a shallow, reference-counted handle to a strided view of shared storage.
//
// Contracts:
//  - Copies of a Tensor are shallow: they share the same TensorImpl (and so the same data, grad and
//    autograd history). clone() makes a deep copy.
//  - Views (view, reshape of a contiguous tensor, transpose, permute, slice, narrow, expand,
//    squeeze, unsqueeze) share storage with their base and are differentiable.
//  - Kernels work on contiguous tensors; every op makes its inputs contiguous first, so any view is
//    a valid input.
//  - A tensor on Device::kMeta has a shape and dtype and no data; every op accepts it and returns
//    meta tensors, which is how models are traced without memory.
//
// Dimension letters used in kernel comments throughout AutoAcc: B batch, T sequence (time),
// C channels (model width), NH attention heads, NKV key/value heads, HS head size (C / NH),
// V vocabulary, M/N/K the GEMM dimensions, F the MLP hidden width.

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "acc/tensor/dtype.hpp"

namespace acc {

using Shape = std::vector<int64_t>;

/// Element count of a shape. Throws acc::ShapeError naming the shape when it does not fit in 64
/// bits.
int64_t numel_of(const Shape& shape);
/// Bytes of a contiguous tensor of this shape and dtype. Throws acc::ShapeError naming the shape
/// when the element count or the bytes do not fit in 64 bits (int64: see acc/util/checked.hpp).
int64_t nbytes_of(const Shape& shape, DType dtype);
std::string to_string(const Shape& shape);
std::ostream& operator<<(std::ostream& os, const Shape& shape);
/// Row-major strides of a contiguous tensor of this shape. Throws acc::ShapeError naming the shape
/// when a stride does not fit in 64 bits (possible only with a zero-size dimension in front).
Shape contiguous_strides(const Shape& shape);

class Tensor;
struct TensorImpl;

namespace autograd {
class Node;
}

/// Memory shared by a tensor and its views. CPU storage owns a block from acc::memory; meta
/// storage owns nothing.
class Storage {
 public:
  Storage(size_t nbytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  /// Unique for the process lifetime, in creation order: how traces name memory (never by
  /// address).
  uint64_t id() const { return id_; }

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  size_t capacity_ = 0;  // of the allocator's block (>= nbytes_)
  Device device_;
  uint64_t id_;
  bool observed_ = false;  // its birth was reported to an OpObserver, so its death is too
};

/// Autograd state of one tensor. Lives in the tensor layer because every tensor carries it; the
/// engine that uses it lives in acc::autograd.
struct AutogradMeta {
  bool requires_grad = false;
  bool retains_grad = false;
  std::shared_ptr<TensorImpl> grad;                // accumulated gradient (a leaf, or retains_grad)
  std::shared_ptr<autograd::Node> grad_fn;         // the op that produced this tensor (non-leaf)
  uint32_t output_nr = 0;                          // which output of grad_fn this tensor is
  std::weak_ptr<autograd::Node> grad_accumulator;  // leaves only
  /// Called after this leaf's gradient for the current backward pass has been fully accumulated
  /// into grad(): the data-parallel reducer attaches here. Each has the id its registration
  /// returned, which removes it.
  std::vector<std::pair<int, std::function<void(Tensor&)>>> post_accumulate_grad_hooks;
  /// Run on each gradient that reaches this leaf, before it is accumulated (register_grad_hook).
  std::vector<std::pair<int, std::function<Tensor(const Tensor&)>>> grad_hooks;
  int next_hook_id = 0;
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  int64_t offset = 0;  // in elements
  Shape shape;
  Shape strides;  // in elements
  DType dtype = DType::kFloat32;
  std::unique_ptr<AutogradMeta> autograd;
  /// Identity a tracer gave this tensor (valid while trace_session matches its session).
  int64_t trace_id = -1;
  uint64_t trace_session = 0;
};

/// The device new tensors get when the caller does not name one: kCPU unless a
/// DefaultDeviceGuard in this thread says otherwise (e.g. kMeta to build a model without memory).
Device default_device();

class DefaultDeviceGuard {
 public:
  explicit DefaultDeviceGuard(Device d);
  ~DefaultDeviceGuard();
  DefaultDeviceGuard(const DefaultDeviceGuard&) = delete;
  DefaultDeviceGuard& operator=(const DefaultDeviceGuard&) = delete;

 private:
  Device prev_;
};

struct TensorOptions {
  DType dtype = DType::kFloat32;
  Device device = default_device();
  bool requires_grad = false;
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const;
  const Shape& strides() const;
  /// Size of dimension d; negative d counts from the end. Throws acc::ShapeError when out of range.
  int64_t size(int64_t d) const;
  int64_t dim() const { return static_cast<int64_t>(shape().size()); }
  int64_t numel() const { return numel_of(shape()); }
  int64_t offset() const { return impl_->offset; }
  DType dtype() const;
  Device device() const;
  bool is_meta() const { return device() == Device::kMeta; }
  bool is_contiguous() const;
  /// Logical bytes (numel x element size); throws acc::ShapeError when they do not fit in 64 bits.
  size_t nbytes() const { return static_cast<size_t>(nbytes_of(shape(), dtype())); }
  TensorOptions options() const { return {dtype(), device(), false}; }
  const std::shared_ptr<Storage>& storage() const { return impl_->storage; }
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  /// True when both handles refer to the same tensor (not merely equal values).
  bool is_same(const Tensor& other) const { return impl_ == other.impl_; }

  /// Typed pointer to the first element. Throws acc::TypeError on a dtype mismatch or a meta
  /// tensor.
  template <class T>
  T* data() const {
    check_data_access(dtype_of<T>::value);
    return static_cast<T*>(impl_->storage->data()) + impl_->offset;
  }
  void* raw_data() const;
  /// The value of a one-element tensor as double.
  double item() const;
  /// A copy of the elements in logical (row-major) order, converted to T.
  template <class T>
  std::vector<T> to_vector() const;

  // ---- views (differentiable; share storage) ----
  /// Same data, new shape; one dimension may be -1. Throws acc::ShapeError when the element count
  /// differs or the tensor's strides do not allow a view.
  Tensor view(Shape shape) const;
  /// view() when possible, else a contiguous copy.
  Tensor reshape(Shape shape) const;
  Tensor flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor permute(std::vector<int64_t> dims) const;
  /// Elements [start, end) of dimension d in steps of `step`; start/end clamp like Python slices.
  Tensor slice(int64_t d, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor narrow(int64_t d, int64_t start, int64_t length) const;
  /// Broadcasts size-1 dimensions (and new leading ones) to `shape`; -1 keeps a size.
  Tensor expand(Shape shape) const;
  Tensor unsqueeze(int64_t d) const;
  Tensor squeeze(int64_t d) const;
  /// Self when contiguous, else a contiguous copy (differentiable).
  Tensor contiguous() const;

  // ---- copies ----
  /// Deep copy, contiguous (differentiable).
  Tensor clone() const;
  /// Converts the dtype (differentiable between floating types); self when already `dtype`.
  Tensor to(DType dtype) const;
  /// Same data, no autograd history, requires_grad false.
  Tensor detach() const;

  // ---- in-place, never recorded by autograd ----
  // Throw acc::ValueError on a tensor that requires grad while grad mode is on (a leaf would be
  // silently corrupted); use them under acc::NoGradGuard.
  Tensor& zero_();
  Tensor& fill_(double value);
  /// Copies src (broadcast to this shape, any dtype) into this tensor's elements.
  Tensor& copy_(const Tensor& src);
  /// this += alpha * other (f32, same shape).
  Tensor& add_(const Tensor& other, double alpha = 1.0);
  Tensor& mul_(double value);

  // ---- autograd ----
  bool requires_grad() const;
  /// Marks a leaf as requiring grad. Throws acc::ValueError on a non-leaf or a non-float tensor.
  Tensor& set_requires_grad(bool requires_grad);
  /// A leaf is a tensor without grad_fn (created by the user, not by an op).
  bool is_leaf() const;
  /// Accumulated gradient (undefined until a backward reaches this tensor).
  Tensor grad() const;
  void set_grad(const Tensor& grad);
  /// Keep grad() for this non-leaf after backward.
  void retain_grad();
  const std::shared_ptr<autograd::Node>& grad_fn() const;
  uint32_t output_nr() const;
  /// Registers fn(param) to run after this leaf's gradient is fully accumulated in a backward.
  /// Returns the id that removes it. Throws acc::ValueError unless this is a leaf requiring grad.
  int register_post_accumulate_grad_hook(std::function<void(Tensor&)> fn);
  /// Removes the hook registered under `id`; an id that is not (or no longer) there is ignored.
  void remove_post_accumulate_grad_hook(int id);
  size_t num_post_accumulate_grad_hooks() const;
  /// Registers fn(grad) to run on each gradient that reaches this leaf in a backward, before it
  /// is added into grad() (PyTorch's Tensor.register_hook on a leaf): what fn returns, of the
  /// gradient's shape, is accumulated instead; an undefined result keeps the gradient. Hooks run
  /// in the order registered. Returns the id that removes it. Throws acc::ValueError unless this
  /// is a leaf requiring grad; the backward throws acc::ShapeError for a result of another shape.
  int register_grad_hook(std::function<Tensor(const Tensor&)> fn);
  /// Removes the hook registered under `id`; an id that is not (or no longer) there is ignored.
  void remove_grad_hook(int id);
  /// Computes gradients of this tensor w.r.t. the leaves. `grad` defaults to 1 for a scalar.
  /// Throws acc::ValueError when the tensor does not require grad, when `grad` is missing for a
  /// non-scalar, or when the graph was already freed by an earlier backward without
  /// retain_graph. Defined in acc::autograd (link acc::autograd to call it).
  void backward(const Tensor& grad = Tensor(), bool retain_graph = false) const;

  AutogradMeta& autograd_meta() const;  // creates it on first use
  bool has_autograd_meta() const { return impl_ && impl_->autograd; }

  std::string to_string() const;

 private:
  void check_defined() const;
  void check_data_access(DType want) const;
  std::shared_ptr<TensorImpl> impl_;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);

// ---- factories ----
Tensor empty(Shape shape, TensorOptions options = {});
Tensor zeros(Shape shape, TensorOptions options = {});
Tensor ones(Shape shape, TensorOptions options = {});
Tensor full(Shape shape, double value, TensorOptions options = {});
Tensor empty_like(const Tensor& t);
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
/// 0, 1, ..., n-1.
Tensor arange(int64_t n, TensorOptions options = {});
/// A tensor holding a copy of `values`, of the given shape (numel must match).
Tensor from_vector(const std::vector<float>& values, Shape shape, TensorOptions options = {});
inline Tensor from_vector(std::initializer_list<float> values, Shape shape,
                          TensorOptions options = {}) {
  return from_vector(std::vector<float>(values), std::move(shape), options);
}
Tensor from_vector(const std::vector<int64_t>& values, Shape shape);
Tensor from_vector(const std::vector<int32_t>& values, Shape shape);
Tensor scalar_tensor(double value, TensorOptions options = {});
/// A tensor over existing storage with arbitrary strides (no checks on aliasing or bounds). Throws
/// acc::ShapeError when the furthest element's offset does not fit in 64 bits.
Tensor make_view(const Tensor& base, Shape shape, Shape strides, int64_t offset);

/// Normalises a possibly negative dimension index; throws acc::ShapeError when out of range.
int64_t wrap_dim(int64_t d, int64_t ndim);

/// True when all elements are within atol + rtol*|b| of each other (shapes must match).
bool allclose(const Tensor& a, const Tensor& b, double rtol = 1e-5, double atol = 1e-8);
/// max |a - b| over elements.
double max_abs_diff(const Tensor& a, const Tensor& b);

}  // namespace acc
