#include "acc/autograd/ops.hpp"
#include "acc/tensor/kernels.hpp"
#include "op_util.hpp"

namespace acc {

Tensor sum(const Tensor& x) {
  detail::check_f32(x, "sum", "x");
  Tensor xc = x.contiguous();
  Tensor out = empty({}, x.options());
  if (!out.is_meta()) {
    *out.data<float>() = static_cast<float>(kernels::sum(xc.data<float>(), xc.numel()));
  }
  Shape shape = x.shape();
  autograd::record_op("SumBackward", {x}, {out},
                      [shape](const std::vector<Tensor>& g, const std::vector<bool>&) {
                        return std::vector<Tensor>{g[0].expand(shape).contiguous()};
                      });
  return out;
}

Tensor sum(const Tensor& x, int64_t dim, bool keepdim) {
  detail::check_f32(x, "sum", "x");
  dim = wrap_dim(dim, x.dim());
  if (x.dim() == 0) return sum(x);  // as in PyTorch: a 0-d tensor reduces to itself
  Tensor xc = x.contiguous();
  const Shape& sh = x.shape();
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= sh[d];
  for (int64_t d = dim + 1; d < x.dim(); ++d) inner *= sh[d];
  const int64_t n = sh[dim];
  Shape kept = sh;
  kept[dim] = 1;
  Tensor out = zeros(kept, x.options());
  if (!out.is_meta()) {
    const float* px = xc.data<float>();
    float* po = out.data<float>();
    for (int64_t o = 0; o < outer; ++o) {
      for (int64_t j = 0; j < n; ++j) {
        const float* row = px + (o * n + j) * inner;
        float* dst = po + o * inner;
        for (int64_t i = 0; i < inner; ++i) dst[i] += row[i];
      }
    }
  }
  autograd::record_op("SumDimBackward", {x}, {out},
                      [sh](const std::vector<Tensor>& g, const std::vector<bool>&) {
                        return std::vector<Tensor>{g[0].expand(sh).contiguous()};
                      });
  if (keepdim) return out;
  return out.squeeze(dim);
}

Tensor mean(const Tensor& x) {
  return scale(sum(x), 1.0 / static_cast<double>(std::max<int64_t>(x.numel(), 1)));
}

Tensor mean(const Tensor& x, int64_t dim, bool keepdim) {
  const int64_t n = x.dim() == 0 ? 1 : x.size(dim);
  return scale(sum(x, dim, keepdim), 1.0 / static_cast<double>(std::max<int64_t>(n, 1)));
}

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  ACC_CHECK(!tensors.empty(), "cat: expects at least one tensor");
  const Tensor& first = tensors[0];
  ACC_CHECK(first.defined(), "cat: tensor 0 is undefined");
  ACC_CHECK_SHAPE(first.dim() > 0, "cat: 0-d tensors cannot be concatenated, got shape ",
                  first.shape());
  dim = wrap_dim(dim, first.dim());
  Shape out_shape = first.shape();
  out_shape[dim] = 0;
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    ACC_CHECK(t.defined(), "cat: tensor ", i, " is undefined");
    ACC_CHECK_TYPE(t.dtype() == first.dtype() && t.device() == first.device(), "cat: tensor ", i,
                   " is ", t.dtype(), "/", t.device(), ", tensor 0 is ", first.dtype(), "/",
                   first.device());
    ACC_CHECK_SHAPE(t.dim() == first.dim(), "cat: tensor ", i, " has shape ", t.shape(),
                    ", tensor 0 has ", first.shape());
    for (int64_t d = 0; d < t.dim(); ++d) {
      ACC_CHECK_SHAPE(d == dim || t.size(d) == first.size(d), "cat: tensor ", i, " has shape ",
                      t.shape(), ", which differs from ", first.shape(), " outside dimension ",
                      dim);
    }
    sizes.push_back(t.size(dim));
    out_shape[dim] += t.size(dim);
  }
  Tensor out = empty(out_shape, first.options());
  if (!out.is_meta()) {
    NoGradGuard ng;
    int64_t off = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      out.narrow(dim, off, sizes[i]).copy_(tensors[i]);
      off += sizes[i];
    }
  }
  autograd::record_op("CatBackward", tensors, {out},
                      [sizes, dim](const std::vector<Tensor>& g, const std::vector<bool>&) {
                        std::vector<Tensor> grads;
                        int64_t off = 0;
                        for (int64_t s : sizes) {
                          grads.push_back(g[0].narrow(dim, off, s));
                          off += s;
                        }
                        return grads;
                      });
  return out;
}

namespace {

// When `ts` are views of one storage with equal strides that sit next to each other along `dim`
// in order (as the gradients of a split are when the op that consumed the parts wrote them into
// one buffer), the view that spans them all; otherwise undefined.
Tensor joined_view(const std::vector<Tensor>& ts, int64_t dim) {
  if (ts.empty()) return Tensor();
  const Tensor& first = ts[0];
  if (!first.defined() || first.is_meta() || !first.storage()) return Tensor();
  Shape shape = first.shape();
  int64_t next = first.offset();
  for (const Tensor& t : ts) {
    if (!t.defined() || t.storage() != first.storage() || t.strides() != first.strides() ||
        t.dtype() != first.dtype() || t.dim() != first.dim() || t.offset() != next) {
      return Tensor();
    }
    for (int64_t d = 0; d < t.dim(); ++d) {
      if (d != dim && t.size(d) != first.size(d)) return Tensor();
    }
    next += t.size(dim) * t.strides()[dim];
  }
  shape[dim] = 0;
  for (const Tensor& t : ts) shape[dim] += t.size(dim);
  return make_view(first, shape, first.strides(), first.offset());
}

}  // namespace

std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim) {
  dim = wrap_dim(dim, x.dim());
  int64_t total = 0;
  for (int64_t s : sizes) {
    ACC_CHECK_SHAPE(s >= 0, "split: negative size in ", to_string(sizes));
    total += s;
  }
  ACC_CHECK_SHAPE(total == x.size(dim), "split: sizes ", to_string(sizes), " add up to ", total,
                  ", but dimension ", dim, " of ", x.shape(), " has ", x.size(dim));
  std::vector<Tensor> outs;
  int64_t off = 0;
  for (int64_t s : sizes) {
    Shape sh = x.shape();
    sh[dim] = s;
    outs.push_back(make_view(x, sh, x.strides(), x.offset() + off * x.strides()[dim]));
    off += s;
  }
  autograd::record_op("SplitBackward", {x}, outs,
                      [dim](const std::vector<Tensor>& g, const std::vector<bool>&) {
                        // No copy when the gradients already lie side by side in one buffer
                        // (fused attention writes dq, dk, dv of a split qkv that way).
                        Tensor joined = joined_view(g, dim);
                        return std::vector<Tensor>{joined.defined() ? joined : cat(g, dim)};
                      });
  return outs;
}

std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim) {
  ACC_CHECK(chunks > 0, "chunk: chunks must be > 0, got ", chunks);
  const int64_t n = x.size(dim);
  ACC_CHECK_SHAPE(n % chunks == 0, "chunk: dimension ", dim, " of size ", n,
                  " does not divide into ", chunks, " chunks");
  return split(x, std::vector<int64_t>(static_cast<size_t>(chunks), n / chunks), dim);
}

}  // namespace acc
