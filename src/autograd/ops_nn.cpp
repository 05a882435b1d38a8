#include <cmath>

#include "acc/autograd/flops.hpp"
#include "acc/autograd/ops.hpp"
#include "acc/autograd/saved.hpp"
#include "acc/tensor/kernels.hpp"
#include "acc/tensor/threading.hpp"
#include "acc/util/checked.hpp"
#include "op_util.hpp"

namespace acc {
namespace {

// Rows of the last dimension: (N, C) with N = numel / C.
int64_t rows_of(const Tensor& x) {
  return x.numel() / std::max<int64_t>(x.size(-1), 1);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// activations

Tensor gelu(const Tensor& x, GeluApprox approximate) {
  detail::check_f32(x, "gelu", "x");
  const bool tanh_approx = approximate == GeluApprox::kTanh;
  Tensor xc = x.contiguous();
  Tensor out = empty(x.shape(), x.options());
  if (!out.is_meta())
    kernels::gelu_forward(out.data<float>(), xc.data<float>(), x.numel(), tanh_approx);
  const autograd::SavedTensor sx(xc, autograd::will_record({&x}));
  autograd::record_op("GeluBackward", {x}, {out},
                      [sx, tanh_approx](const std::vector<Tensor>& g, const std::vector<bool>&) {
                        const Tensor xc = sx.get();
                        Tensor gc = g[0].contiguous();
                        Tensor dx = empty(xc.shape(), xc.options());
                        if (!dx.is_meta()) {
                          kernels::gelu_backward(dx.data<float>(), xc.data<float>(),
                                                 gc.data<float>(), xc.numel(), tanh_approx);
                        }
                        return std::vector<Tensor>{dx};
                      });
  return out;
}

Tensor silu(const Tensor& x) {
  detail::check_f32(x, "silu", "x");
  Tensor xc = x.contiguous();
  Tensor out = empty(x.shape(), x.options());
  if (!out.is_meta()) kernels::silu_forward(out.data<float>(), xc.data<float>(), x.numel());
  const autograd::SavedTensor sx(xc, autograd::will_record({&x}));
  autograd::record_op(
      "SiluBackward", {x}, {out}, [sx](const std::vector<Tensor>& g, const std::vector<bool>&) {
        const Tensor xc = sx.get();
        Tensor gc = g[0].contiguous();
        Tensor dx = empty(xc.shape(), xc.options());
        if (!dx.is_meta()) {
          kernels::silu_backward(dx.data<float>(), xc.data<float>(), gc.data<float>(), xc.numel());
        }
        return std::vector<Tensor>{dx};
      });
  return out;
}

Tensor relu(const Tensor& x) {
  detail::check_f32(x, "relu", "x");
  Tensor xc = x.contiguous();
  Tensor out = empty(x.shape(), x.options());
  if (!out.is_meta()) kernels::relu_forward(out.data<float>(), xc.data<float>(), x.numel());
  const autograd::SavedTensor sx(xc, autograd::will_record({&x}));
  autograd::record_op(
      "ReluBackward", {x}, {out}, [sx](const std::vector<Tensor>& g, const std::vector<bool>&) {
        const Tensor xc = sx.get();
        Tensor gc = g[0].contiguous();
        Tensor dx = empty(xc.shape(), xc.options());
        if (!dx.is_meta()) {
          kernels::relu_backward(dx.data<float>(), xc.data<float>(), gc.data<float>(), xc.numel());
        }
        return std::vector<Tensor>{dx};
      });
  return out;
}

Tensor swiglu(const Tensor& gate, const Tensor& up) {
  detail::check_f32(gate, "swiglu", "gate");
  detail::check_f32(up, "swiglu", "up");
  detail::check_same_device("swiglu", {&gate, &up});
  ACC_CHECK_SHAPE(gate.shape() == up.shape(), "swiglu: gate ", gate.shape(), " and up ", up.shape(),
                  " differ");
  Tensor gc = gate.contiguous(), uc = up.contiguous();
  Tensor out = empty(gate.shape(), gate.options());
  if (!out.is_meta()) {
    kernels::swiglu_forward(out.data<float>(), gc.data<float>(), uc.data<float>(), out.numel());
  }
  const bool recorded = autograd::will_record({&gate, &up});
  const autograd::SavedTensor sg(gc, recorded), su(uc, recorded);
  autograd::record_op("SwigluBackward", {gate, up}, {out},
                      [sg, su](const std::vector<Tensor>& g, const std::vector<bool>& need) {
                        const Tensor gc = sg.get(), uc = su.get();
                        Tensor d = g[0].contiguous();
                        Tensor dg = need[0] ? empty(gc.shape(), gc.options()) : Tensor();
                        Tensor du = need[1] ? empty(uc.shape(), uc.options()) : Tensor();
                        if (!d.is_meta()) {
                          kernels::swiglu_backward(need[0] ? dg.data<float>() : nullptr,
                                                   need[1] ? du.data<float>() : nullptr,
                                                   gc.data<float>(), uc.data<float>(),
                                                   d.data<float>(), gc.numel());
                        }
                        return std::vector<Tensor>{dg, du};
                      });
  return out;
}

Tensor dropout(const Tensor& x, double p, bool training, Generator& gen) {
  return dropout(x, p, training, gen, TensorChunk{});
}

Tensor dropout(const Tensor& x, double p, bool training, Generator& gen, const TensorChunk& chunk) {
  detail::check_f32(x, "dropout", "x");
  ACC_CHECK(p >= 0.0 && p < 1.0, "dropout: p must be in [0, 1), got ", p);
  if (!training || p == 0.0) return x;
  Tensor mask = empty(x.shape(), x.options());
  if (!mask.is_meta()) {
    uniform_(mask, 0.0, 1.0, chunk, gen);
    float* m = mask.data<float>();
    const float keep = static_cast<float>(1.0 / (1.0 - p)), pf = static_cast<float>(p);
    const int64_t n = mask.numel();
    for (int64_t i = 0; i < n; ++i) m[i] = m[i] < pf ? 0.f : keep;
  }
  Tensor out = kernels::binary(kernels::BinaryOp::kMul, x, mask);
  autograd::record_op(
      "DropoutBackward", {x}, {out},
      [mask](const std::vector<Tensor>& g, const std::vector<bool>&) {
        return std::vector<Tensor>{kernels::binary(kernels::BinaryOp::kMul, g[0], mask)};
      });
  return out;
}

// ---------------------------------------------------------------------------------------------
// normalisation

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  detail::check_f32(x, "layer_norm", "input");
  detail::check_f32(weight, "layer_norm", "weight");
  detail::check_same_device("layer_norm", {&x, &weight, &bias});
  ACC_CHECK(eps > 0, "layer_norm: eps must be > 0, got ", eps);
  const int64_t C = x.size(-1), N = rows_of(x);
  ACC_CHECK_SHAPE(weight.shape() == Shape{C}, "layer_norm: weight ", weight.shape(),
                  " does not match the last dimension of input ", x.shape());
  const bool has_bias = bias.defined();
  if (has_bias) {
    detail::check_f32(bias, "layer_norm", "bias");
    ACC_CHECK_SHAPE(bias.shape() == Shape{C}, "layer_norm: bias ", bias.shape(),
                    " does not match the last dimension of input ", x.shape());
  }
  Tensor xc = x.contiguous();
  Tensor out = empty(x.shape(), x.options());
  Tensor mean = empty({N}, x.options()), rstd = empty({N}, x.options());
  if (!out.is_meta()) {
    kernels::layernorm_forward(out.data<float>(), mean.data<float>(), rstd.data<float>(),
                               xc.data<float>(), weight.contiguous().data<float>(),
                               has_bias ? bias.contiguous().data<float>() : nullptr, N, C,
                               static_cast<float>(eps));
  }
  std::vector<Tensor> inputs{x, weight};
  if (has_bias) inputs.push_back(bias);
  Tensor w = weight.contiguous();
  const autograd::SavedTensor sx(xc, autograd::will_record({&x, &weight, &bias}));
  autograd::record_op("LayerNormBackward", inputs, {out},
                      [sx, w, mean, rstd, N, C, has_bias](const std::vector<Tensor>& g,
                                                          const std::vector<bool>& need) {
                        const Tensor xc = sx.get();
                        Tensor gc = g[0].contiguous();
                        Tensor dx = empty(xc.shape(), xc.options());
                        Tensor dw = need[1] ? zeros({C}, xc.options()) : Tensor();
                        Tensor db = has_bias && need[2] ? zeros({C}, xc.options()) : Tensor();
                        if (!dx.is_meta()) {
                          kernels::layernorm_backward(
                              dx.data<float>(), dw.defined() ? dw.data<float>() : nullptr,
                              db.defined() ? db.data<float>() : nullptr, gc.data<float>(),
                              xc.data<float>(), w.data<float>(), mean.data<float>(),
                              rstd.data<float>(), N, C);
                        }
                        std::vector<Tensor> grads{need[0] ? dx : Tensor(), dw};
                        if (has_bias) grads.push_back(db);
                        return grads;
                      });
  return out;
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  detail::check_f32(x, "rms_norm", "input");
  detail::check_f32(weight, "rms_norm", "weight");
  detail::check_same_device("rms_norm", {&x, &weight});
  ACC_CHECK(eps > 0, "rms_norm: eps must be > 0, got ", eps);
  const int64_t C = x.size(-1), N = rows_of(x);
  ACC_CHECK_SHAPE(weight.shape() == Shape{C}, "rms_norm: weight ", weight.shape(),
                  " does not match the last dimension of input ", x.shape());
  Tensor xc = x.contiguous(), w = weight.contiguous();
  Tensor out = empty(x.shape(), x.options());
  Tensor rstd = empty({N}, x.options());
  if (!out.is_meta()) {
    kernels::rmsnorm_forward(out.data<float>(), rstd.data<float>(), xc.data<float>(),
                             w.data<float>(), N, C, static_cast<float>(eps));
  }
  const autograd::SavedTensor sx(xc, autograd::will_record({&x, &weight}));
  autograd::record_op(
      "RmsNormBackward", {x, weight}, {out},
      [sx, w, rstd, N, C](const std::vector<Tensor>& g, const std::vector<bool>& need) {
        const Tensor xc = sx.get();
        Tensor gc = g[0].contiguous();
        Tensor dx = empty(xc.shape(), xc.options());
        Tensor dw = need[1] ? zeros({C}, xc.options()) : Tensor();
        if (!dx.is_meta()) {
          kernels::rmsnorm_backward(dx.data<float>(), dw.defined() ? dw.data<float>() : nullptr,
                                    gc.data<float>(), xc.data<float>(), w.data<float>(),
                                    rstd.data<float>(), N, C);
        }
        return std::vector<Tensor>{need[0] ? dx : Tensor(), dw};
      });
  return out;
}

namespace {
Tensor softmax_last(const Tensor& x, bool log) {
  const char* name = log ? "log_softmax" : "softmax";
  detail::check_f32(x, name, "x");
  ACC_CHECK_SHAPE(x.dim() >= 1, name, ": expects at least one dimension, got ", x.shape());
  const int64_t C = x.size(-1), N = rows_of(x);
  Tensor xc = x.contiguous();
  Tensor out = empty(x.shape(), x.options());
  if (!out.is_meta()) {
    (log ? kernels::log_softmax_forward : kernels::softmax_forward)(out.data<float>(),
                                                                    xc.data<float>(), N, C);
  }
  Tensor y = detail::saved_output(out);
  autograd::record_op(log ? "LogSoftmaxBackward" : "SoftmaxBackward", {x}, {out},
                      [y, N, C, log](const std::vector<Tensor>& g, const std::vector<bool>&) {
                        Tensor gc = g[0].contiguous();
                        Tensor dx = empty(y.shape(), y.options());
                        if (!dx.is_meta()) {
                          (log ? kernels::log_softmax_backward : kernels::softmax_backward)(
                              dx.data<float>(), y.data<float>(), gc.data<float>(), N, C);
                        }
                        return std::vector<Tensor>{dx};
                      });
  return out;
}

Tensor softmax_dim(const Tensor& x, int64_t dim, bool log) {
  dim = wrap_dim(dim, x.dim());
  if (dim == x.dim() - 1) return softmax_last(x, log);
  return softmax_last(x.transpose(dim, -1), log).transpose(dim, -1);
}
}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) {
  return softmax_dim(x, dim, false);
}
Tensor log_softmax(const Tensor& x, int64_t dim) {
  return softmax_dim(x, dim, true);
}

// ---------------------------------------------------------------------------------------------
// attention

namespace {

// q/k/v-shaped operand with a unit-stride last dimension (copied when it has none).
Tensor with_unit_inner_stride(const Tensor& t) {
  return t.strides().back() == 1 || t.size(-1) == 1 ? t : t.contiguous();
}

kernels::AttnOperand operand(const Tensor& t) {
  const auto& s = t.strides();
  return {t.data<float>(), s[0], s[1], s[2]};
}
kernels::AttnGrad grad_operand(const Tensor& t) {
  const auto& s = t.strides();
  return {t.data<float>(), s[0], s[1], s[2]};
}

// A (B,H,T,HS) tensor stored as (B,T,H,HS): attention's output is then (B,T,C) rows for the
// output projection, and the gradients of q, k, v are laid out as their projection wrote them.
Tensor bthd_tensor(int64_t B, int64_t H, int64_t T, int64_t HS, TensorOptions opt) {
  Tensor store = empty({B, T, H, HS}, opt);
  return make_view(store, {B, H, T, HS}, {T * H * HS, HS, H * HS, 1}, 0);
}

// True when q, k, v are the head views of one (B, T, NH + 2 NKV, HS) tensor, q's heads then k's
// then v's (a split of one qkv projection).
bool packed_qkv(const Tensor& q, const Tensor& k, const Tensor& v) {
  const int64_t B = q.size(0), NH = q.size(1), T = q.size(2), HS = q.size(3), NKV = k.size(1);
  const int64_t st = (NH + 2 * NKV) * HS;
  const Shape qs{T * st, HS, st, 1};
  auto kv_strides = [&](const Tensor& t) { return t.strides() == Shape{T * st, HS, st, 1}; };
  return B > 0 && T > 0 && q.storage() && q.storage() == k.storage() &&
         q.storage() == v.storage() && q.strides() == qs && kv_strides(k) && kv_strides(v) &&
         k.offset() == q.offset() + NH * HS && v.offset() == k.offset() + NKV * HS;
}

}  // namespace

Tensor scaled_dot_product_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                    bool causal, double scale) {
  const char* op = "scaled_dot_product_attention";
  detail::check_f32(q_in, op, "q");
  detail::check_f32(k_in, op, "k");
  detail::check_f32(v_in, op, "v");
  detail::check_same_device(op, {&q_in, &k_in, &v_in});
  ACC_CHECK_SHAPE(q_in.dim() == 4 && k_in.dim() == 4 && v_in.dim() == 4, op,
                  ": expects q, k, v of shape (B, H, T, HS), got ", q_in.shape(), ", ",
                  k_in.shape(), ", ", v_in.shape());
  const int64_t B = q_in.size(0), NH = q_in.size(1), T = q_in.size(2), HS = q_in.size(3);
  const int64_t NKV = k_in.size(1);
  ACC_CHECK_SHAPE(k_in.shape() == v_in.shape(), op, ": k ", k_in.shape(), " and v ", v_in.shape(),
                  " differ");
  ACC_CHECK_SHAPE(k_in.size(0) == B && k_in.size(2) == T && k_in.size(3) == HS, op, ": k ",
                  k_in.shape(), " does not match q ", q_in.shape());
  ACC_CHECK_SHAPE(NKV > 0 && NH % NKV == 0, op, ": query heads ", NH,
                  " are not a multiple of key/value heads ", NKV);
  const float sc =
      static_cast<float>(std::isnan(scale) ? 1.0 / std::sqrt(static_cast<double>(HS)) : scale);
  Tensor q = with_unit_inner_stride(q_in), k = with_unit_inner_stride(k_in),
         v = with_unit_inner_stride(v_in);
  Tensor out = bthd_tensor(B, NH, T, HS, q.options());
  Tensor lse = empty({B, NH, T}, q.options());
  // Scores and values: 2 products of 2 * T * T * HS per head, half of them under a causal mask.
  const int64_t attn_flops = autograd::attention_flops(B, NH, T, HS, causal);
  const int64_t bwd_flops = checked_mul(attn_flops, 2, "attention backward FLOPs");
  if (!out.is_meta() && out.numel() > 0) {
    kernels::attention_forward(grad_operand(out), lse.data<float>(), operand(q), operand(k),
                               operand(v), B, NH, NKV, T, HS, sc, causal);
  }
  const bool packed = !q.is_meta() && packed_qkv(q, k, v);
  const bool recorded = autograd::will_record({&q_in, &k_in, &v_in});
  const autograd::SavedTensor sq(q, recorded), sk(k, recorded), sv(v, recorded),
      so(detail::saved_output(out), recorded);
  // Reported after the saved tensors' bf16 copies (ops of their own under amp): the FLOPs go to
  // the op recorded next.
  autograd::detail::add_flops(attn_flops, false);
  autograd::record_op("AttentionBackward", {q_in, k_in, v_in}, {out},
                      [sq, sk, sv, so, lse, B, NH, NKV, T, HS, sc, causal, bwd_flops, packed](
                          const std::vector<Tensor>& g, const std::vector<bool>&) {
                        const Tensor q = sq.get(), k = sk.get(), v = sv.get(), o = so.get();
                        Tensor go = with_unit_inner_stride(g[0]);
                        Tensor dq, dk, dv;
                        if (packed) {
                          // Gradients laid out like q, k, v: side by side in one buffer, so the
                          // backward of the qkv split needs no concatenation.
                          const Tensor all = bthd_tensor(B, NH + 2 * NKV, T, HS, q.options());
                          const int64_t o0 = all.offset();
                          dq = make_view(all, {B, NH, T, HS}, all.strides(), o0);
                          dk = make_view(all, {B, NKV, T, HS}, all.strides(), o0 + NH * HS);
                          dv = make_view(all, {B, NKV, T, HS}, all.strides(), o0 + (NH + NKV) * HS);
                        } else {
                          dq = bthd_tensor(B, NH, T, HS, q.options());
                          dk = bthd_tensor(B, NKV, T, HS, q.options());
                          dv = bthd_tensor(B, NKV, T, HS, q.options());
                        }
                        autograd::detail::add_flops(bwd_flops, true);
                        if (!dq.is_meta() && dq.numel() > 0) {
                          kernels::attention_backward(
                              grad_operand(dq), grad_operand(dk), grad_operand(dv), operand(go),
                              operand(q), operand(k), operand(v), operand(o), lse.data<float>(), B,
                              NH, NKV, T, HS, sc, causal);
                        }
                        return std::vector<Tensor>{dq, dk, dv};
                      });
  return out;
}

Tensor attention_reference(const Tensor& q, const Tensor& k, const Tensor& v, bool causal) {
  ACC_CHECK_SHAPE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
                  "attention_reference: expects (B, H, T, HS), got ", q.shape(), ", ", k.shape(),
                  ", ", v.shape());
  const int64_t NH = q.size(1), NKV = k.size(1), T = q.size(2), HS = q.size(3);
  ACC_CHECK_SHAPE(NKV > 0 && NH % NKV == 0, "attention_reference: query heads ", NH,
                  " are not a multiple of key/value heads ", NKV);
  Tensor kk = k, vv = v;
  if (NKV != NH) {
    // Repeat each kv head NH/NKV times: (B,NKV,T,HS) -> (B,NKV,G,T,HS) -> (B,NH,T,HS).
    const int64_t G = NH / NKV, B = q.size(0);
    kk = k.unsqueeze(2).expand({B, NKV, G, T, HS}).reshape({B, NH, T, HS});
    vv = v.unsqueeze(2).expand({B, NKV, G, T, HS}).reshape({B, NH, T, HS});
  }
  Tensor att = scale(matmul(q, kk.transpose(-2, -1)), 1.0 / std::sqrt(static_cast<double>(HS)));
  if (causal) {
    Tensor mask = zeros({T, T}, q.options());
    if (!mask.is_meta()) {
      float* m = mask.data<float>();
      for (int64_t i = 0; i < T; ++i) {
        for (int64_t j = i + 1; j < T; ++j) m[i * T + j] = -INFINITY;
      }
    }
    att = add(att, mask);
  }
  return matmul(softmax(att, -1), vv);
}

std::pair<Tensor, Tensor> rope_cache(int64_t T, int64_t HS, double theta, Device device) {
  ACC_CHECK(T > 0, "rope_cache: T must be > 0, got ", T);
  ACC_CHECK(HS > 0 && HS % 2 == 0, "rope_cache: head size must be even and > 0, got ", HS);
  ACC_CHECK(theta > 0, "rope_cache: theta must be > 0, got ", theta);
  Tensor c = empty({T, HS}, {DType::kFloat32, device, false});
  Tensor s = empty({T, HS}, {DType::kFloat32, device, false});
  if (device == Device::kMeta) return {c, s};
  const int64_t half = HS / 2;
  const float base = static_cast<float>(theta);
  float* pc = c.data<float>();
  float* ps = s.data<float>();
  for (int64_t i = 0; i < half; ++i) {
    // f32 throughout, as transformers' LlamaRotaryEmbedding computes it.
    const float inv_freq =
        1.0f / std::pow(base, static_cast<float>(2 * i) / static_cast<float>(HS));
    for (int64_t t = 0; t < T; ++t) {
      const float f = static_cast<float>(t) * inv_freq;
      pc[t * HS + i] = pc[t * HS + i + half] = std::cos(f);
      ps[t * HS + i] = ps[t * HS + i + half] = std::sin(f);
    }
  }
  return {c, s};
}

Tensor rotary_embedding(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  detail::check_f32(x, "rotary_embedding", "x");
  detail::check_f32(cos, "rotary_embedding", "cos");
  detail::check_f32(sin, "rotary_embedding", "sin");
  detail::check_same_device("rotary_embedding", {&x, &cos, &sin});
  ACC_CHECK_SHAPE(x.dim() == 4, "rotary_embedding: expects x of shape (B, H, T, HS), got ",
                  x.shape());
  const int64_t T = x.size(2), HS = x.size(3);
  ACC_CHECK_SHAPE(HS % 2 == 0, "rotary_embedding: head size must be even, got ", HS);
  ACC_CHECK_SHAPE(
      cos.dim() == 2 && cos.size(0) >= T && cos.size(1) == HS && sin.shape() == cos.shape(),
      "rotary_embedding: tables ", cos.shape(), "/", sin.shape(), " do not cover x ", x.shape());
  Tensor c = cos.narrow(0, 0, T).contiguous(), s = sin.narrow(0, 0, T).contiguous();
  Tensor xc = x.contiguous();
  const int64_t R = x.size(0) * x.size(1);
  Tensor out = empty(x.shape(), x.options());
  if (!out.is_meta()) {
    kernels::rope_forward(out.data<float>(), xc.data<float>(), c.data<float>(), s.data<float>(), R,
                          T, HS, false);
  }
  autograd::record_op("RotaryBackward", {x}, {out},
                      [c, s, R, T, HS](const std::vector<Tensor>& g, const std::vector<bool>&) {
                        Tensor gc = g[0].contiguous();
                        Tensor dx = empty(gc.shape(), gc.options());
                        if (!dx.is_meta()) {
                          kernels::rope_forward(dx.data<float>(), gc.data<float>(), c.data<float>(),
                                                s.data<float>(), R, T, HS, true);
                        }
                        return std::vector<Tensor>{dx};
                      });
  return out;
}

// ---------------------------------------------------------------------------------------------
// embedding and loss

namespace {
template <class Index>
void check_range(const Tensor& idx, int64_t V, const char* op, const char* what,
                 int64_t ignore_index, bool allow_ignore) {
  const Index* p = idx.data<Index>();
  const int64_t n = idx.numel();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = static_cast<int64_t>(p[i]);
    if (allow_ignore && v == ignore_index) continue;
    ACC_CHECK(v >= 0 && v < V, op, ": ", what, " ", v, " at position ", i, " is out of range [0, ",
              V, ")");
  }
}
void check_indices(const Tensor& idx, int64_t V, const char* op, const char* what,
                   int64_t ignore_index = 0, bool allow_ignore = false) {
  if (idx.is_meta()) return;
  if (idx.dtype() == DType::kInt64) {
    check_range<int64_t>(idx, V, op, what, ignore_index, allow_ignore);
  } else {
    check_range<int32_t>(idx, V, op, what, ignore_index, allow_ignore);
  }
}
}  // namespace

Tensor embedding(const Tensor& idx_in, const Tensor& weight) {
  detail::check_index(idx_in, "embedding", "indices");
  detail::check_f32(weight, "embedding", "weight");
  detail::check_same_device("embedding", {&idx_in, &weight});
  ACC_CHECK_SHAPE(weight.dim() == 2, "embedding: weight must be (V, C), got ", weight.shape());
  const int64_t V = weight.size(0), C = weight.size(1), N = idx_in.numel();
  Tensor idx = idx_in.contiguous(), w = weight.contiguous();
  check_indices(idx, V, "embedding", "index");
  Shape out_shape = idx.shape();
  out_shape.push_back(C);
  Tensor out = empty(out_shape, weight.options());
  if (!out.is_meta()) {
    if (idx.dtype() == DType::kInt64) {
      kernels::embedding_forward(out.data<float>(), idx.data<int64_t>(), w.data<float>(), N, C);
    } else {
      kernels::embedding_forward(out.data<float>(), idx.data<int32_t>(), w.data<float>(), N, C);
    }
  }
  autograd::record_op("EmbeddingBackward", {idx_in, weight}, {out},
                      [idx, V, C, N, opt = weight.options()](const std::vector<Tensor>& g,
                                                             const std::vector<bool>&) {
                        Tensor gc = g[0].contiguous();
                        Tensor dw = zeros({V, C}, opt);
                        if (!dw.is_meta()) {
                          if (idx.dtype() == DType::kInt64) {
                            kernels::embedding_backward(dw.data<float>(), idx.data<int64_t>(),
                                                        gc.data<float>(), N, C, V);
                          } else {
                            kernels::embedding_backward(dw.data<float>(), idx.data<int32_t>(),
                                                        gc.data<float>(), N, C, V);
                          }
                        }
                        return std::vector<Tensor>{Tensor(), dw};
                      });
  return out;
}

Tensor cross_entropy(const Tensor& logits, const Tensor& targets_in, int64_t ignore_index) {
  detail::check_f32(logits, "cross_entropy", "logits");
  detail::check_index(targets_in, "cross_entropy", "targets");
  detail::check_same_device("cross_entropy", {&logits, &targets_in});
  ACC_CHECK_SHAPE(logits.dim() >= 1, "cross_entropy: logits need a class dimension, got ",
                  logits.shape());
  const int64_t V = logits.size(-1), N = rows_of(logits);
  ACC_CHECK_SHAPE(targets_in.numel() == N, "cross_entropy: logits ", logits.shape(), " need ", N,
                  " targets, got shape ", targets_in.shape());
  Tensor x = logits.contiguous(), targets = targets_in.contiguous();
  check_indices(targets, V, "cross_entropy", "target", ignore_index, true);
  Tensor out = empty({}, logits.options());
  Tensor lse = empty({N}, logits.options());
  int64_t count = N;
  if (!out.is_meta()) {
    Tensor losses = empty({N}, logits.options());
    if (targets.dtype() == DType::kInt64) {
      kernels::cross_entropy_forward(losses.data<float>(), lse.data<float>(), x.data<float>(),
                                     targets.data<int64_t>(), N, V, ignore_index);
    } else {
      kernels::cross_entropy_forward(losses.data<float>(), lse.data<float>(), x.data<float>(),
                                     targets.data<int32_t>(), N, V, ignore_index);
    }
    auto tv = targets.to_vector<int64_t>();
    count = 0;
    for (int64_t t : tv) count += t != ignore_index;
    const double total = kernels::sum(losses.data<float>(), N);
    *out.data<float>() = static_cast<float>(total / static_cast<double>(count));
  }
  autograd::record_op(
      "CrossEntropyBackward", {logits, targets_in}, {out},
      [x, targets, lse, N, V, count, ignore_index](const std::vector<Tensor>& g,
                                                   const std::vector<bool>&) {
        Tensor dx = empty(x.shape(), x.options());
        if (!dx.is_meta()) {
          const float gscale = static_cast<float>(g[0].item() / static_cast<double>(count));
          std::vector<float> dloss(static_cast<size_t>(N), gscale);
          if (targets.dtype() == DType::kInt64) {
            kernels::cross_entropy_backward(dx.data<float>(), x.data<float>(), lse.data<float>(),
                                            targets.data<int64_t>(), dloss.data(), N, V,
                                            ignore_index);
          } else {
            kernels::cross_entropy_backward(dx.data<float>(), x.data<float>(), lse.data<float>(),
                                            targets.data<int32_t>(), dloss.data(), N, V,
                                            ignore_index);
          }
        }
        return std::vector<Tensor>{dx, Tensor()};
      });
  return out;
}

}  // namespace acc
