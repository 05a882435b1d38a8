#include "acc/tensor/tensor.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <numeric>
#include <optional>
#include <sstream>

#include "acc/tensor/allocator.hpp"
#include "acc/tensor/kernels.hpp"
#include "acc/tensor/node.hpp"
#include "acc/tensor/observer.hpp"
#include "acc/util/checked.hpp"
#include "acc/util/error.hpp"
#include "strided.hpp"

namespace acc {

// ---------------------------------------------------------------------------------------------
// shapes

int64_t numel_of(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) {
    // A product that does not fit would wrap to a small or negative count: every size computed
    // from it (bytes, FLOPs, memory estimates) would be silently wrong.
    ACC_CHECK_SHAPE(!__builtin_mul_overflow(n, s, &n), "shape ", to_string(shape),
                    " has more elements than fit in 64 bits");
  }
  return n;
}

int64_t nbytes_of(const Shape& shape, DType dtype) {
  // The message made only when it is thrown (checked_mul throws it, with the same operands): every
  // tensor made asks this (a trace makes 10^7).
  const int64_t n = numel_of(shape), size = static_cast<int64_t>(element_size(dtype));
  int64_t bytes = 0;
  if (__builtin_mul_overflow(n, size, &bytes)) [[unlikely]] {
    (void)checked_mul<ShapeError>(n, size, "bytes of shape ", to_string(shape), " (",
                                  dtype_name(dtype), ")");
  }
  return bytes;
}

std::string to_string(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::ostream& operator<<(std::ostream& os, const Shape& shape) {
  return os << to_string(shape);
}

Shape contiguous_strides(const Shape& shape) {
  Shape st(shape.size());
  int64_t s = 1;
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    st[d] = s;
    // Zero-size dimensions count as 1, so a stride can exceed the (zero) element count.
    // The message made only when it is thrown (checked_mul throws it), as in nbytes_of.
    if (d > 0 && __builtin_mul_overflow(s, std::max<int64_t>(shape[d], 1), &s)) [[unlikely]] {
      (void)checked_mul<ShapeError>(st[d], std::max<int64_t>(shape[d], 1), "strides of shape ",
                                    to_string(shape));
    }
  }
  return st;
}

int64_t wrap_dim(int64_t d, int64_t ndim) {
  int64_t lo = ndim == 0 ? -1 : -ndim, hi = ndim == 0 ? 0 : ndim - 1;
  ACC_CHECK_SHAPE(d >= lo && d <= hi, "dimension ", d, " out of range for a tensor of ", ndim,
                  " dimensions");
  return d < 0 ? d + std::max<int64_t>(ndim, 1) : d;
}

namespace detail {
Shape broadcast_strides(const Tensor& t, const Shape& out) {
  Shape st(out.size(), 0);
  const int64_t off = static_cast<int64_t>(out.size()) - t.dim();
  for (int64_t d = 0; d < t.dim(); ++d) {
    st[off + d] = t.shape()[d] == 1 ? 0 : t.strides()[d];
  }
  return st;
}
}  // namespace detail

// ---------------------------------------------------------------------------------------------
// default device

namespace {
thread_local Device tls_default_device = Device::kCPU;
}
Device default_device() {
  return tls_default_device;
}
DefaultDeviceGuard::DefaultDeviceGuard(Device d) : prev_(tls_default_device) {
  tls_default_device = d;
}
DefaultDeviceGuard::~DefaultDeviceGuard() {
  tls_default_device = prev_;
}

// ---------------------------------------------------------------------------------------------
// storage

namespace {
std::atomic<uint64_t> next_storage_id{1};
}

Storage::Storage(size_t nbytes, Device device)
    : nbytes_(nbytes), device_(device), id_(next_storage_id.fetch_add(1)) {
  if (device == Device::kCPU && nbytes > 0) {
    const memory::Block b = memory::allocate(nbytes);
    data_ = b.ptr;
    capacity_ = b.capacity;
  }
  if (detail::OpObserver* obs = detail::op_observer()) {
    obs->on_alloc(id_, nbytes, device);
    observed_ = true;
  }
}

Storage::~Storage() {
  if (data_ != nullptr) memory::deallocate({data_, capacity_}, nbytes_);
  if (observed_) {
    if (detail::OpObserver* obs = detail::op_observer()) obs->on_free(id_);
  }
}

// ---------------------------------------------------------------------------------------------
// basic accessors

void Tensor::check_defined() const {
  ACC_CHECK(impl_ != nullptr, "operation on an undefined tensor");
}

const Shape& Tensor::shape() const {
  check_defined();
  return impl_->shape;
}
const Shape& Tensor::strides() const {
  check_defined();
  return impl_->strides;
}
DType Tensor::dtype() const {
  check_defined();
  return impl_->dtype;
}
Device Tensor::device() const {
  check_defined();
  return impl_->storage->device();
}

int64_t Tensor::size(int64_t d) const {
  // wrap_dim accepts 0 and -1 for a 0-d tensor (reductions over its only "dimension"), but a 0-d
  // tensor has no size to read.
  ACC_CHECK_SHAPE(dim() > 0, "size: dimension ", d, " out of range for a 0-d tensor");
  return shape()[wrap_dim(d, dim())];
}

bool Tensor::is_contiguous() const {
  const Shape& sh = shape();
  if (numel_of(sh) == 0) return true;
  int64_t expect = 1;
  for (int64_t d = dim() - 1; d >= 0; --d) {
    if (sh[d] == 1) continue;
    if (impl_->strides[d] != expect) return false;
    expect *= sh[d];
  }
  return true;
}

void Tensor::check_data_access(DType want) const {
  check_defined();
  ACC_CHECK_TYPE(impl_->dtype == want, "tensor has dtype ", impl_->dtype, ", accessed as ", want);
  ACC_CHECK_TYPE(!is_meta(), "a meta tensor (shape ", impl_->shape, ") has no data");
}

void* Tensor::raw_data() const {
  check_defined();
  ACC_CHECK_TYPE(!is_meta(), "a meta tensor (shape ", impl_->shape, ") has no data");
  return static_cast<char*>(impl_->storage->data()) + impl_->offset * element_size(impl_->dtype);
}

namespace {
double load_element(DType t, const void* p) {
  switch (t) {
    case DType::kFloat32:
      return *static_cast<const float*>(p);
    case DType::kBFloat16:
      return static_cast<float>(*static_cast<const BFloat16*>(p));
    case DType::kInt32:
      return static_cast<double>(*static_cast<const int32_t*>(p));
    case DType::kInt64:
      return static_cast<double>(*static_cast<const int64_t*>(p));
  }
  return 0;
}
}  // namespace

double Tensor::item() const {
  ACC_CHECK_SHAPE(numel() == 1, "item() needs a tensor with one element, got shape ", shape());
  return load_element(dtype(), raw_data());
}

namespace {
template <class T>
T load_as(DType t, const void* p) {
  switch (t) {
    case DType::kFloat32:
      return static_cast<T>(*static_cast<const float*>(p));
    case DType::kBFloat16:
      return static_cast<T>(static_cast<float>(*static_cast<const BFloat16*>(p)));
    case DType::kInt32:
      return static_cast<T>(*static_cast<const int32_t*>(p));
    case DType::kInt64:
      return static_cast<T>(*static_cast<const int64_t*>(p));
  }
  return T{};
}
}  // namespace

template <class T>
std::vector<T> Tensor::to_vector() const {
  Tensor c = contiguous();
  std::vector<T> out(static_cast<size_t>(c.numel()));
  if (out.empty()) return out;
  const char* p = static_cast<const char*>(c.raw_data());
  const size_t es = element_size(c.dtype());
  for (size_t i = 0; i < out.size(); ++i) out[i] = load_as<T>(c.dtype(), p + i * es);
  return out;
}
template std::vector<float> Tensor::to_vector<float>() const;
template std::vector<double> Tensor::to_vector<double>() const;
template std::vector<int64_t> Tensor::to_vector<int64_t>() const;
template std::vector<int32_t> Tensor::to_vector<int32_t>() const;

// ---------------------------------------------------------------------------------------------
// factories

Tensor empty(Shape shape, TensorOptions options) {
  for (int64_t s : shape) ACC_CHECK_SHAPE(s >= 0, "negative size in shape ", shape);
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(static_cast<size_t>(nbytes_of(shape, options.dtype)),
                                            options.device);
  impl->strides = contiguous_strides(shape);
  impl->shape = std::move(shape);
  impl->dtype = options.dtype;
  Tensor t(std::move(impl));
  if (options.requires_grad) t.set_requires_grad(true);
  return t;
}

Tensor full(Shape shape, double value, TensorOptions options) {
  bool rg = options.requires_grad;
  options.requires_grad = false;
  Tensor t = empty(std::move(shape), options);
  if (!t.is_meta()) t.fill_(value);
  if (rg) t.set_requires_grad(true);
  return t;
}
Tensor zeros(Shape shape, TensorOptions options) {
  return full(std::move(shape), 0.0, options);
}
Tensor ones(Shape shape, TensorOptions options) {
  return full(std::move(shape), 1.0, options);
}
Tensor empty_like(const Tensor& t) {
  return empty(t.shape(), t.options());
}
Tensor zeros_like(const Tensor& t) {
  return zeros(t.shape(), t.options());
}
Tensor ones_like(const Tensor& t) {
  return ones(t.shape(), t.options());
}

Tensor arange(int64_t n, TensorOptions options) {
  ACC_CHECK(n >= 0, "arange: n must be >= 0, got ", n);
  Tensor t = empty({n}, {options.dtype, options.device, false});
  if (t.is_meta()) return t;
  switch (options.dtype) {
    case DType::kFloat32:
      std::iota(t.data<float>(), t.data<float>() + n, 0.0f);
      break;
    case DType::kInt32:
      std::iota(t.data<int32_t>(), t.data<int32_t>() + n, 0);
      break;
    case DType::kInt64:
      std::iota(t.data<int64_t>(), t.data<int64_t>() + n, int64_t{0});
      break;
    case DType::kBFloat16:
      for (int64_t i = 0; i < n; ++i) t.data<BFloat16>()[i] = BFloat16(static_cast<float>(i));
      break;
  }
  return t;
}

namespace {
template <class T>
Tensor from_values(const std::vector<T>& values, Shape shape, DType dtype) {
  ACC_CHECK_SHAPE(numel_of(shape) == static_cast<int64_t>(values.size()),
                  "from_vector: ", values.size(), " values do not fill shape ", shape);
  Tensor t = empty(std::move(shape), {dtype_of<T>::value, Device::kCPU, false});
  if (!values.empty()) std::memcpy(t.raw_data(), values.data(), values.size() * sizeof(T));
  return dtype == dtype_of<T>::value ? t : t.to(dtype);
}
}  // namespace

Tensor from_vector(const std::vector<float>& values, Shape shape, TensorOptions options) {
  if (options.device == Device::kMeta) {
    ACC_CHECK_SHAPE(numel_of(shape) == static_cast<int64_t>(values.size()),
                    "from_vector: ", values.size(), " values do not fill shape ", shape);
    return empty(std::move(shape), options);
  }
  Tensor t = from_values(values, std::move(shape), options.dtype);
  if (options.requires_grad) t.set_requires_grad(true);
  return t;
}
Tensor from_vector(const std::vector<int64_t>& values, Shape shape) {
  return from_values(values, std::move(shape), DType::kInt64);
}
Tensor from_vector(const std::vector<int32_t>& values, Shape shape) {
  return from_values(values, std::move(shape), DType::kInt32);
}
Tensor scalar_tensor(double value, TensorOptions options) {
  return full({}, value, options);
}

Tensor make_view(const Tensor& base, Shape shape, Shape strides, int64_t offset) {
  // The furthest element's offset fits, so every kernel's index arithmetic over the view does.
  if (std::find(shape.begin(), shape.end(), 0) == shape.end()) {
    int64_t last = offset;
    for (size_t d = 0; d < shape.size() && d < strides.size(); ++d) {
      last = checked_add<ShapeError>(
          last, checked_mul<ShapeError>(shape[d] - 1, strides[d], "view of shape ", shape),
          "view of shape ", shape, " at offset ", offset);
    }
  }
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = base.storage();
  impl->offset = offset;
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->dtype = base.dtype();
  return Tensor(std::move(impl));
}

// ---------------------------------------------------------------------------------------------
// views

namespace {

Shape infer_shape(Shape shape, int64_t numel, const Shape& from) {
  int64_t infer = -1, known = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      ACC_CHECK_SHAPE(infer < 0, "only one dimension can be -1, got ", shape);
      infer = static_cast<int64_t>(i);
    } else {
      ACC_CHECK_SHAPE(shape[i] >= 0, "invalid size in shape ", shape);
      known = checked_mul<ShapeError>(known, shape[i], "shape ", shape);
    }
  }
  if (infer >= 0) {
    ACC_CHECK_SHAPE(known > 0 && numel % known == 0, "shape ", shape,
                    " is invalid for a tensor of shape ", from, " (", numel, " elements)");
    shape[infer] = numel / known;
  }
  ACC_CHECK_SHAPE(numel_of(shape) == numel, "shape ", shape, " is invalid for a tensor of shape ",
                  from, " (", numel, " elements)");
  return shape;
}

// Strides for viewing (old shape, old strides) as new shape without a copy, or empty when the
// layout does not allow it: each run of old dimensions that is contiguous in memory can be split
// into new dimensions freely.
std::optional<Shape> view_strides(const Shape& old_shape, const Shape& old_strides,
                                  const Shape& new_shape) {
  Shape new_strides(new_shape.size());
  if (numel_of(old_shape) == 0) return contiguous_strides(new_shape);
  int64_t view_d = static_cast<int64_t>(new_shape.size()) - 1;
  int64_t chunk_base_stride = old_strides.empty() ? 1 : old_strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t tensor_d = static_cast<int64_t>(old_shape.size()) - 1; tensor_d >= 0; --tensor_d) {
    tensor_numel *= old_shape[tensor_d];
    if (tensor_d == 0 || (old_shape[tensor_d - 1] != 1 &&
                          old_strides[tensor_d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || new_shape[view_d] == 1)) {
        new_strides[view_d] = view_numel * chunk_base_stride;
        view_numel *= new_shape[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (tensor_d > 0) {
        chunk_base_stride = old_strides[tensor_d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) {
    // Remaining new dims must all be 1.
    for (; view_d >= 0; --view_d) {
      if (new_shape[view_d] != 1) return std::nullopt;
      new_strides[view_d] = 1;
    }
  }
  return new_strides;
}

void record_view(const char* name, const Tensor& in, const Tensor& out,
                 std::function<Tensor(const Tensor&)> backward) {
  autograd::record_op(
      name, {in}, {out},
      [bw = std::move(backward)](const std::vector<Tensor>& g, const std::vector<bool>&) {
        return std::vector<Tensor>{bw(g[0])};
      });
}

}  // namespace

Tensor Tensor::view(Shape new_shape) const {
  Shape sh = infer_shape(std::move(new_shape), numel(), shape());
  auto st = view_strides(shape(), strides(), sh);
  ACC_CHECK_SHAPE(st.has_value(), "view ", sh, " is not compatible with the strides ", strides(),
                  " of a tensor of shape ", shape(), "; use reshape()");
  Tensor out = make_view(*this, sh, *st, offset());
  Shape in_shape = shape();
  record_view("ViewBackward", *this, out,
              [in_shape](const Tensor& g) { return g.reshape(in_shape); });
  return out;
}

Tensor Tensor::reshape(Shape new_shape) const {
  Shape sh = infer_shape(std::move(new_shape), numel(), shape());
  if (view_strides(shape(), strides(), sh)) return view(sh);
  return contiguous().view(sh);
}

Tensor Tensor::flatten(int64_t start_dim, int64_t end_dim) const {
  if (dim() == 0) return reshape({1});
  int64_t s = wrap_dim(start_dim, dim()), e = wrap_dim(end_dim, dim());
  ACC_CHECK_SHAPE(s <= e, "flatten: start_dim ", start_dim, " after end_dim ", end_dim);
  Shape sh(shape().begin(), shape().begin() + s);
  int64_t m = 1;
  for (int64_t d = s; d <= e; ++d)
    m = checked_mul<ShapeError>(m, shape()[d], "flatten of ", shape());
  sh.push_back(m);
  sh.insert(sh.end(), shape().begin() + e + 1, shape().end());
  return reshape(sh);
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  std::vector<int64_t> perm(static_cast<size_t>(dim()));
  std::iota(perm.begin(), perm.end(), 0);
  const int64_t a = wrap_dim(d0, dim()), b = wrap_dim(d1, dim());
  if (dim() == 0) return permute(perm);  // 0 and -1 name no real dimension of a 0-d tensor
  std::swap(perm[a], perm[b]);
  return permute(perm);
}

Tensor Tensor::permute(std::vector<int64_t> dims) const {
  ACC_CHECK_SHAPE(static_cast<int64_t>(dims.size()) == dim(), "permute: ", dims.size(),
                  " dims given for a tensor of ", dim(), " dimensions");
  std::vector<bool> seen(dims.size(), false);
  Shape sh(dims.size()), st(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) {
    int64_t d = wrap_dim(dims[i], dim());
    ACC_CHECK_SHAPE(!seen[d], "permute: dimension ", d, " repeated in ", ::acc::to_string(dims));
    seen[d] = true;
    dims[i] = d;
    sh[i] = shape()[d];
    st[i] = strides()[d];
  }
  Tensor out = make_view(*this, sh, st, offset());
  std::vector<int64_t> inv(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) inv[dims[i]] = static_cast<int64_t>(i);
  record_view("PermuteBackward", *this, out, [inv](const Tensor& g) { return g.permute(inv); });
  return out;
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  d = wrap_dim(d, dim());
  ACC_CHECK_SHAPE(step > 0, "slice: step must be positive, got ", step);
  const int64_t n = shape()[d];
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Shape sh = shape(), st = strides();
  sh[d] = (end - start + step - 1) / step;
  st[d] *= step;
  Tensor out = make_view(*this, sh, st, offset() + start * strides()[d]);
  Shape in_shape = shape();
  TensorOptions opt = options();
  record_view("SliceBackward", *this, out, [=](const Tensor& g) {
    Tensor gi = zeros(in_shape, opt);
    NoGradGuard ng;
    gi.slice(d, start, end, step).copy_(g);
    return gi;
  });
  return out;
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  d = wrap_dim(d, dim());
  ACC_CHECK_SHAPE(start >= 0 && length >= 0 && start + length <= shape()[d], "narrow: [", start,
                  ", ", start + length, ") out of range for dimension ", d, " of size ",
                  shape()[d]);
  return slice(d, start, start + length);
}

Tensor Tensor::expand(Shape new_shape) const {
  ACC_CHECK_SHAPE(static_cast<int64_t>(new_shape.size()) >= dim(), "expand: cannot expand ",
                  shape(), " to fewer dimensions ", new_shape);
  const int64_t off = static_cast<int64_t>(new_shape.size()) - dim();
  Shape st(new_shape.size(), 0);
  for (int64_t i = 0; i < static_cast<int64_t>(new_shape.size()); ++i) {
    if (i < off) {
      ACC_CHECK_SHAPE(new_shape[i] >= 0, "expand: invalid size ", new_shape[i], " in ", new_shape);
      continue;
    }
    int64_t have = shape()[i - off];
    if (new_shape[i] == -1) new_shape[i] = have;
    if (have == new_shape[i]) {
      st[i] = strides()[i - off];
    } else {
      ACC_CHECK_SHAPE(have == 1, "expand: cannot expand ", shape(), " to ", new_shape);
    }
  }
  Tensor out = make_view(*this, new_shape, st, offset());
  Shape in_shape = shape();
  record_view("ExpandBackward", *this, out,
              [in_shape](const Tensor& g) { return kernels::sum_to(g, in_shape); });
  return out;
}

Tensor Tensor::unsqueeze(int64_t d) const {
  d = wrap_dim(d, dim() + 1);
  Shape sh = shape();
  sh.insert(sh.begin() + d, 1);
  return view(sh);
}

Tensor Tensor::squeeze(int64_t d) const {
  d = wrap_dim(d, dim());
  if (shape()[d] != 1) return *this;
  Shape sh = shape();
  sh.erase(sh.begin() + d);
  return view(sh);
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return clone();
}

Tensor Tensor::clone() const {
  Tensor out = empty(shape(), options());
  if (!is_meta()) {
    NoGradGuard ng;
    out.copy_(*this);
  }
  record_view("CloneBackward", *this, out, [](const Tensor& g) { return g; });
  return out;
}

Tensor Tensor::to(DType t) const {
  if (t == dtype()) return *this;
  Tensor out = empty(shape(), {t, device(), false});
  if (!is_meta()) {
    NoGradGuard ng;
    out.copy_(*this);
  }
  if (is_floating(t) && is_floating(dtype())) {
    DType src = dtype();
    record_view("ToBackward", *this, out, [src](const Tensor& g) { return g.to(src); });
  }
  return out;
}

Tensor Tensor::detach() const {
  return make_view(*this, shape(), strides(), offset());
}

// ---------------------------------------------------------------------------------------------
// in-place

namespace {
void check_inplace(const Tensor& t, const char* op) {
  ACC_CHECK(!(GradMode::is_enabled() && t.requires_grad()), op,
            ": in-place update of a tensor that requires grad (shape ", t.shape(),
            "); run it under acc::NoGradGuard");
}

template <class Dst, class Src>
void copy_rows(const Tensor& dst, const Tensor& src) {
  Dst* d = static_cast<Dst*>(dst.raw_data());
  const Src* s = static_cast<const Src*>(src.raw_data());
  std::array<Shape, 2> st{dst.strides(), detail::broadcast_strides(src, dst.shape())};
  detail::for_each_row<2>(
      dst.shape(), st,
      [&](const std::array<int64_t, 2>& off, int64_t n, const std::array<int64_t, 2>& inc) {
        Dst* dp = d + off[0];
        const Src* sp = s + off[1];
        if (inc[0] == 1 && inc[1] == 1) {
          for (int64_t i = 0; i < n; ++i) {
            if constexpr (std::is_same_v<Dst, BFloat16>) {
              dp[i] = BFloat16(static_cast<float>(sp[i]));
            } else {
              dp[i] = static_cast<Dst>(sp[i]);
            }
          }
        } else {
          for (int64_t i = 0; i < n; ++i) {
            if constexpr (std::is_same_v<Dst, BFloat16>) {
              dp[i * inc[0]] = BFloat16(static_cast<float>(sp[i * inc[1]]));
            } else {
              dp[i * inc[0]] = static_cast<Dst>(sp[i * inc[1]]);
            }
          }
        }
      });
}

template <class Dst>
void copy_from(const Tensor& dst, const Tensor& src) {
  switch (src.dtype()) {
    case DType::kFloat32:
      copy_rows<Dst, float>(dst, src);
      break;
    case DType::kBFloat16:
      copy_rows<Dst, BFloat16>(dst, src);
      break;
    case DType::kInt32:
      copy_rows<Dst, int32_t>(dst, src);
      break;
    case DType::kInt64:
      copy_rows<Dst, int64_t>(dst, src);
      break;
  }
}
}  // namespace

Tensor& Tensor::copy_(const Tensor& src) {
  check_inplace(*this, "copy_");
  ACC_CHECK_SHAPE(src.dim() <= dim(), "copy_: cannot broadcast ", src.shape(), " to ", shape());
  for (int64_t i = 0; i < src.dim(); ++i) {
    int64_t s = src.shape()[src.dim() - 1 - i], d = shape()[dim() - 1 - i];
    ACC_CHECK_SHAPE(s == d || s == 1, "copy_: cannot broadcast ", src.shape(), " to ", shape());
  }
  ACC_CHECK_TYPE(src.device() == device(), "copy_: device mismatch ", src.device(), " -> ",
                 device());
  if (is_meta() || numel() == 0) return *this;
  switch (dtype()) {
    case DType::kFloat32:
      copy_from<float>(*this, src);
      break;
    case DType::kBFloat16:
      copy_from<BFloat16>(*this, src);
      break;
    case DType::kInt32:
      copy_from<int32_t>(*this, src);
      break;
    case DType::kInt64:
      copy_from<int64_t>(*this, src);
      break;
  }
  return *this;
}

Tensor& Tensor::fill_(double value) {
  check_inplace(*this, "fill_");
  if (is_meta() || numel() == 0) return *this;
  Tensor v = empty({}, {dtype(), Device::kCPU, false});
  switch (dtype()) {
    case DType::kFloat32:
      *v.data<float>() = static_cast<float>(value);
      break;
    case DType::kBFloat16:
      *v.data<BFloat16>() = BFloat16(static_cast<float>(value));
      break;
    case DType::kInt32:
      *v.data<int32_t>() = static_cast<int32_t>(value);
      break;
    case DType::kInt64:
      *v.data<int64_t>() = static_cast<int64_t>(value);
      break;
  }
  if (is_contiguous() && dtype() == DType::kFloat32) {
    float* p = data<float>();
    const float fv = static_cast<float>(value);
    parallel_for(numel(), 1 << 16, [&](int64_t b, int64_t e) { std::fill(p + b, p + e, fv); });
    return *this;
  }
  NoGradGuard ng;
  return copy_(v);
}

Tensor& Tensor::zero_() {
  return fill_(0.0);
}

Tensor& Tensor::add_(const Tensor& other, double alpha) {
  check_inplace(*this, "add_");
  ACC_CHECK_SHAPE(other.shape() == shape(), "add_: shape ", other.shape(), " does not match ",
                  shape());
  ACC_CHECK_TYPE(dtype() == DType::kFloat32 && other.dtype() == DType::kFloat32,
                 "add_: expects f32 tensors, got ", dtype(), " and ", other.dtype());
  if (is_meta()) return *this;
  Tensor o = other.contiguous();
  if (is_contiguous()) {
    kernels::axpy(numel(), static_cast<float>(alpha), o.data<float>(), data<float>());
  } else {
    NoGradGuard ng;
    Tensor tmp = contiguous();
    kernels::axpy(numel(), static_cast<float>(alpha), o.data<float>(), tmp.data<float>());
    copy_(tmp);
  }
  return *this;
}

Tensor& Tensor::mul_(double value) {
  check_inplace(*this, "mul_");
  ACC_CHECK_TYPE(dtype() == DType::kFloat32, "mul_: expects an f32 tensor, got ", dtype());
  if (is_meta()) return *this;
  ACC_CHECK(is_contiguous(), "mul_: expects a contiguous tensor, got strides ", strides());
  kernels::scale(numel(), static_cast<float>(value), data<float>());
  return *this;
}

// ---------------------------------------------------------------------------------------------
// autograd accessors (the engine itself is in acc::autograd)

AutogradMeta& Tensor::autograd_meta() const {
  check_defined();
  if (!impl_->autograd) impl_->autograd = std::make_unique<AutogradMeta>();
  return *impl_->autograd;
}

bool Tensor::requires_grad() const {
  return impl_ && impl_->autograd && (impl_->autograd->requires_grad || impl_->autograd->grad_fn);
}

Tensor& Tensor::set_requires_grad(bool rg) {
  check_defined();
  ACC_CHECK(is_leaf(), "set_requires_grad: only leaf tensors can be marked (shape ", shape(), ")");
  ACC_CHECK_TYPE(!rg || is_floating(dtype()), "set_requires_grad: only floating tensors can ",
                 "require grad, got ", dtype());
  autograd_meta().requires_grad = rg;
  return *this;
}

bool Tensor::is_leaf() const {
  return !(impl_ && impl_->autograd && impl_->autograd->grad_fn);
}

Tensor Tensor::grad() const {
  if (!has_autograd_meta() || !impl_->autograd->grad) return Tensor();
  return Tensor(impl_->autograd->grad);
}

void Tensor::set_grad(const Tensor& g) {
  if (g.defined()) {
    ACC_CHECK_SHAPE(g.shape() == shape(), "set_grad: gradient shape ", g.shape(),
                    " does not match tensor shape ", shape());
  }
  autograd_meta().grad = g.impl_ptr();
}

void Tensor::retain_grad() {
  ACC_CHECK(requires_grad(), "retain_grad on a tensor that does not require grad");
  if (is_leaf() || autograd_meta().retains_grad) return;
  AutogradMeta& meta = autograd_meta();
  meta.retains_grad = true;
  std::weak_ptr<TensorImpl> weak = impl_;
  const uint32_t nr = meta.output_nr;
  meta.grad_fn->add_pre_hook([weak, nr](const std::vector<Tensor>& grads) {
    auto impl = weak.lock();
    if (!impl || nr >= grads.size() || !grads[nr].defined()) return;
    Tensor self(impl);
    Tensor g = self.grad();
    self.set_grad(g.defined() ? kernels::binary(kernels::BinaryOp::kAdd, g, grads[nr])
                              : grads[nr].clone());
  });
}

const std::shared_ptr<autograd::Node>& Tensor::grad_fn() const {
  static const std::shared_ptr<autograd::Node> none;
  if (!has_autograd_meta()) return none;
  return impl_->autograd->grad_fn;
}

uint32_t Tensor::output_nr() const {
  return has_autograd_meta() ? impl_->autograd->output_nr : 0;
}

int Tensor::register_post_accumulate_grad_hook(std::function<void(Tensor&)> fn) {
  ACC_CHECK(is_leaf() && requires_grad(),
            "post-accumulate-grad hooks need a leaf that requires grad (shape ", shape(), ")");
  AutogradMeta& meta = autograd_meta();
  meta.post_accumulate_grad_hooks.emplace_back(meta.next_hook_id, std::move(fn));
  return meta.next_hook_id++;
}

void Tensor::remove_post_accumulate_grad_hook(int id) {
  if (!has_autograd_meta()) return;
  std::erase_if(impl_->autograd->post_accumulate_grad_hooks,
                [id](const auto& h) { return h.first == id; });
}

size_t Tensor::num_post_accumulate_grad_hooks() const {
  return has_autograd_meta() ? impl_->autograd->post_accumulate_grad_hooks.size() : 0;
}

int Tensor::register_grad_hook(std::function<Tensor(const Tensor&)> fn) {
  ACC_CHECK(is_leaf() && requires_grad(), "gradient hooks need a leaf that requires grad (shape ",
            shape(), ")");
  AutogradMeta& meta = autograd_meta();
  meta.grad_hooks.emplace_back(meta.next_hook_id, std::move(fn));
  return meta.next_hook_id++;
}

void Tensor::remove_grad_hook(int id) {
  if (!has_autograd_meta()) return;
  std::erase_if(impl_->autograd->grad_hooks, [id](const auto& h) { return h.first == id; });
}

// ---------------------------------------------------------------------------------------------
// printing and comparison

std::string Tensor::to_string() const {
  if (!defined()) return "Tensor(undefined)";
  std::ostringstream os;
  os << "Tensor(shape=" << shape() << ", dtype=" << dtype() << ", device=" << device();
  if (!is_meta() && numel() <= 16) {
    os << ", values=[";
    auto v = to_vector<double>();
    for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << std::setprecision(6) << v[i];
    os << "]";
  }
  if (requires_grad()) os << ", requires_grad";
  return os.str() + ")";
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) {
  return os << t.to_string();
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  ACC_CHECK_SHAPE(a.shape() == b.shape(), "max_abs_diff: shapes ", a.shape(), " and ", b.shape(),
                  " differ");
  auto va = a.to_vector<double>(), vb = b.to_vector<double>();
  double m = 0;
  for (size_t i = 0; i < va.size(); ++i) m = std::max(m, std::abs(va[i] - vb[i]));
  return m;
}

bool allclose(const Tensor& a, const Tensor& b, double rtol, double atol) {
  ACC_CHECK_SHAPE(a.shape() == b.shape(), "allclose: shapes ", a.shape(), " and ", b.shape(),
                  " differ");
  auto va = a.to_vector<double>(), vb = b.to_vector<double>();
  for (size_t i = 0; i < va.size(); ++i) {
    if (!(std::abs(va[i] - vb[i]) <= atol + rtol * std::abs(vb[i]))) return false;
  }
  return true;
}

}  // namespace acc
