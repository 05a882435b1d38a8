#include "acc/nn/transformer.hpp"

#include "acc/util/error.hpp"

namespace acc::nn {

Activation parse_activation(const std::string& name) {
  if (name == "gelu_tanh" || name == "gelu_new" || name == "gelu_pytorch_tanh") {
    return Activation::kGeluTanh;
  }
  if (name == "gelu") return Activation::kGelu;
  if (name == "relu") return Activation::kRelu;
  if (name == "silu" || name == "swish") return Activation::kSilu;
  ACC_THROW(ValueError, "unknown activation '", name, "' (expected gelu_tanh, gelu, relu or silu)");
}

Tensor activate(const Tensor& x, Activation a) {
  switch (a) {
    case Activation::kGeluTanh:
      return gelu(x, GeluApprox::kTanh);
    case Activation::kGelu:
      return gelu(x, GeluApprox::kNone);
    case Activation::kRelu:
      return relu(x);
    case Activation::kSilu:
      return silu(x);
  }
  return x;
}

// ---------------------------------------------------------------------------------------------

namespace {

// The number of heads of HS features in the output `out` (B, T, width) of the projection `proj`
// of `attn`, `parts` heads' worth side by side (3 for GPT's fused q|k|v).
int64_t heads_from_width(const Module& attn, const char* proj, const Tensor& out, int64_t B,
                         int64_t T, int64_t HS, int64_t parts = 1) {
  ACC_CHECK_SHAPE(out.dim() == 3 && out.size(0) == B && out.size(1) == T, attn.type_name(), " '",
                  attn.qualified_name(), "': ", proj, " gives ", out.shape(), " for (", B, ", ", T,
                  ", .) tokens");
  const int64_t width = out.size(2);
  ACC_CHECK_SHAPE(width > 0 && width % (parts * HS) == 0, attn.type_name(), " '",
                  attn.qualified_name(), "': ", proj, " gives ", width, " features, not ",
                  parts > 1 ? std::to_string(parts) + " x " : std::string(),
                  "a multiple of head_dim ", HS, parts > 1 ? " (q | k | v of whole heads)" : "");
  return width / (parts * HS);
}

// Positions [offset, offset + T) must be rows of the rotary tables.
void check_positions(const Tensor& table, int64_t offset, int64_t T) {
  ACC_CHECK(offset >= 0 && offset + T <= table.size(0), "LlamaAttention: positions [", offset, ", ",
            offset + T, ") (position_offset ", offset, ", sequence length ", T,
            ") are not within max_position_embeddings ", table.size(0));
}

}  // namespace

Undo AttentionCoreHooks::wrap_core(AttentionCoreWrapper wrapper) {
  ACC_CHECK(static_cast<bool>(wrapper), "wrap_core: the wrapper is empty");
  const int id = next_id_++;
  wrappers_.emplace_back(id, std::move(wrapper));
  return [this, id] {
    for (auto it = wrappers_.begin(); it != wrappers_.end(); ++it) {
      if (it->first == id) {
        wrappers_.erase(it);
        return;
      }
    }
  };
}

Tensor AttentionCoreHooks::run_core(const Tensor& q, const Tensor& k, const Tensor& v) const {
  // Built from the innermost out: the plain core, then each wrapper around the one before.
  AttentionCore core = [fused = fused_](const Tensor& q, const Tensor& k, const Tensor& v) {
    return fused ? scaled_dot_product_attention(q, k, v, /*causal=*/true)
                 : attention_reference(q, k, v, /*causal=*/true);
  };
  for (const auto& entry : wrappers_) {
    const AttentionCoreWrapper& w = entry.second;
    // The wrapper by value: a core a recomputation replays in backward outlives this call.
    core = [w, inner = std::move(core)](const Tensor& q, const Tensor& k, const Tensor& v) {
      return w(inner, q, k, v);
    };
  }
  return core(q, k, v);
}

Undo wrap_attention_cores(Module& root, const AttentionCoreWrapper& wrapper) {
  std::vector<Undo> undos;
  auto visit = [&](Module& m) {
    if (auto* a = dynamic_cast<AttentionCoreHooks*>(&m)) undos.push_back(a->wrap_core(wrapper));
  };
  visit(root);
  for (const auto& [name, m] : root.named_modules()) {
    if (m.get() != &root) visit(*m);
  }
  ACC_CHECK(
      !undos.empty(), "the model (", root.type_name(),
      ") has no attention (nn::CausalSelfAttention or nn::LlamaAttention) whose core to wrap");
  return undo_all(std::move(undos));
}

CausalSelfAttention::CausalSelfAttention(int64_t n_embd, int64_t n_head, bool bias, double dropout,
                                         Generator& gen)
    : Module("CausalSelfAttention"), n_embd_(n_embd), head_dim_(0) {
  ACC_CHECK(n_head > 0 && n_embd % n_head == 0, "CausalSelfAttention: n_embd ", n_embd,
            " is not a multiple of n_head ", n_head);
  head_dim_ = n_embd / n_head;
  c_attn_ = register_module("c_attn", std::make_shared<Linear>(n_embd, 3 * n_embd, bias, gen));
  c_proj_ = register_module("c_proj", std::make_shared<Linear>(n_embd, n_embd, bias, gen));
  if (dropout > 0)
    resid_drop_ = register_module("resid_dropout", std::make_shared<Dropout>(dropout, gen));
}

Tensor CausalSelfAttention::forward(const Tensor& x) {
  ACC_CHECK_SHAPE(x.dim() == 3 && x.size(2) == n_embd_, "CausalSelfAttention: expects (B, T, ",
                  n_embd_, "), got ", x.shape());
  const int64_t B = x.size(0), HS = head_dim_;
  Tensor qkv = c_attn_(x);  // (B, T, 3C), C = NH * HS: the heads c_attn holds
  // The tokens as c_attn gives them: a sequence-parallel c_attn gathers x's chunk of them.
  const int64_t T = qkv.dim() == 3 ? qkv.size(1) : x.size(1);
  const int64_t NH = heads_from_width(*this, "c_attn", qkv, B, T, HS, 3), C = NH * HS;
  auto parts = split(qkv, {C, C, C}, 2);
  // (B, T, C) -> (B, NH, T, HS): views only, the attention kernel reads the strides.
  Tensor q = parts[0].view({B, T, NH, HS}).transpose(1, 2);
  Tensor k = parts[1].view({B, T, NH, HS}).transpose(1, 2);
  Tensor v = parts[2].view({B, T, NH, HS}).transpose(1, 2);
  Tensor y = run_core(q, k, v);
  y = y.transpose(1, 2).reshape({B, T, C});
  y = c_proj_(y);
  return resid_drop_ ? resid_drop_(y) : y;
}

MLP::MLP(int64_t n_embd, int64_t hidden, bool bias, Activation act, double dropout, Generator& gen)
    : Module("MLP"), act_(act) {
  c_fc_ = register_module("c_fc", std::make_shared<Linear>(n_embd, hidden, bias, gen));
  c_proj_ = register_module("c_proj", std::make_shared<Linear>(hidden, n_embd, bias, gen));
  if (dropout > 0) drop_ = register_module("dropout", std::make_shared<Dropout>(dropout, gen));
}

Tensor MLP::forward(const Tensor& x) {
  Tensor h = activate(c_fc_(x), act_);
  h = c_proj_(h);
  return drop_ ? drop_(h) : h;
}

SwiGLUMLP::SwiGLUMLP(int64_t hidden_size, int64_t intermediate_size, Generator& gen)
    : Module("SwiGLUMLP") {
  gate_proj_ = register_module(
      "gate_proj", std::make_shared<Linear>(hidden_size, intermediate_size, false, gen));
  up_proj_ = register_module("up_proj",
                             std::make_shared<Linear>(hidden_size, intermediate_size, false, gen));
  down_proj_ = register_module(
      "down_proj", std::make_shared<Linear>(intermediate_size, hidden_size, false, gen));
}

Tensor SwiGLUMLP::forward(const Tensor& x) {
  // Separate statements: the order of ops (and so of traces) follows the source.
  Tensor gate = gate_proj_(x);
  Tensor up = up_proj_(x);
  return down_proj_(swiglu(gate, up));
}

GPTBlock::GPTBlock(int64_t n_embd, int64_t n_head, bool bias, Activation act, double dropout,
                   Generator& gen)
    : Module("GPTBlock") {
  ln_1_ = register_module("ln_1", std::make_shared<LayerNorm>(n_embd, 1e-5, bias));
  attn_ = register_module(
      "attn", std::make_shared<CausalSelfAttention>(n_embd, n_head, bias, dropout, gen));
  ln_2_ = register_module("ln_2", std::make_shared<LayerNorm>(n_embd, 1e-5, bias));
  mlp_ = register_module("mlp", std::make_shared<MLP>(n_embd, 4 * n_embd, bias, act, dropout, gen));
}

Tensor GPTBlock::forward(const Tensor& x) {
  Tensor h = add(x, attn_(ln_1_(x)));
  return add(h, mlp_(ln_2_(h)));
}

LlamaAttention::LlamaAttention(int64_t hidden_size, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, std::pair<Tensor, Tensor> rope, Generator& gen)
    : Module("LlamaAttention"),
      head_dim_(head_dim),
      rope_cos_(std::move(rope.first)),
      rope_sin_(std::move(rope.second)) {
  ACC_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
            "LlamaAttention: num_attention_heads ", num_heads,
            " is not a multiple of num_key_value_heads ", num_kv_heads);
  ACC_CHECK(head_dim > 0 && head_dim % 2 == 0, "LlamaAttention: head_dim must be even, got ",
            head_dim);
  q_proj_ = register_module(
      "q_proj", std::make_shared<Linear>(hidden_size, num_heads * head_dim, false, gen));
  k_proj_ = register_module(
      "k_proj", std::make_shared<Linear>(hidden_size, num_kv_heads * head_dim, false, gen));
  v_proj_ = register_module(
      "v_proj", std::make_shared<Linear>(hidden_size, num_kv_heads * head_dim, false, gen));
  o_proj_ = register_module(
      "o_proj", std::make_shared<Linear>(num_heads * head_dim, hidden_size, false, gen));
}

Tensor LlamaAttention::forward(const Tensor& x) {
  ACC_CHECK_SHAPE(x.dim() == 3, "LlamaAttention: expects (B, T, C), got ", x.shape());
  const int64_t B = x.size(0), HS = head_dim_;
  const int64_t offset = current_forward_options().position_offset;
  // Heads as the projections give them: NH and NKV are this attention's (a shard's) own; the
  // tokens too (a sequence-parallel projection gathers x's chunk of them).
  Tensor qp = q_proj_(x);
  const int64_t T = qp.dim() == 3 ? qp.size(1) : x.size(1);
  check_positions(rope_cos_, offset, T);
  const int64_t NH = heads_from_width(*this, "q_proj", qp, B, T, HS);
  Tensor q = qp.view({B, T, NH, HS}).transpose(1, 2);
  Tensor kp = k_proj_(x);
  const int64_t NKV = heads_from_width(*this, "k_proj", kp, B, T, HS);
  Tensor k = kp.view({B, T, NKV, HS}).transpose(1, 2);
  Tensor vp = v_proj_(x);
  ACC_CHECK_SHAPE(vp.shape() == kp.shape(), "LlamaAttention '", qualified_name(),
                  "': v_proj gives ", vp.shape(), " but k_proj ", kp.shape(),
                  " (a value head per key head)");
  ACC_CHECK_SHAPE(NH % NKV == 0, "LlamaAttention '", qualified_name(), "': ", NH,
                  " query heads (q_proj) are not a multiple of ", NKV, " key/value heads (k_proj)");
  Tensor v = vp.view({B, T, NKV, HS}).transpose(1, 2);
  q = rotate(q, offset);
  k = rotate(k, offset);
  Tensor y = run_core(q, k, v);
  y = y.transpose(1, 2).reshape({B, T, NH * HS});
  return o_proj_(y);
}

Tensor LlamaAttention::rotate(const Tensor& heads, int64_t offset) const {
  ACC_CHECK_SHAPE(heads.dim() == 4 && heads.size(3) == head_dim_,
                  "LlamaAttention: rotate expects heads (B, H, T, ", head_dim_, "), got ",
                  heads.shape());
  const int64_t T = heads.size(2);
  check_positions(rope_cos_, offset, T);
  // Rows [offset, offset + T) of the tables: position offset + t gets exactly the cos/sin row the
  // whole sequence's token offset + t gets.
  return rotary_embedding(heads, rope_cos_.narrow(0, offset, T), rope_sin_.narrow(0, offset, T));
}

LlamaBlock::LlamaBlock(int64_t hidden_size, int64_t intermediate_size, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, std::pair<Tensor, Tensor> rope,
                       double rms_norm_eps, Generator& gen)
    : Module("LlamaBlock") {
  input_layernorm_ =
      register_module("input_layernorm", std::make_shared<RMSNorm>(hidden_size, rms_norm_eps));
  self_attn_ = register_module(
      "self_attn", std::make_shared<LlamaAttention>(hidden_size, num_heads, num_kv_heads, head_dim,
                                                    std::move(rope), gen));
  post_attention_layernorm_ = register_module("post_attention_layernorm",
                                              std::make_shared<RMSNorm>(hidden_size, rms_norm_eps));
  mlp_ = register_module("mlp", std::make_shared<SwiGLUMLP>(hidden_size, intermediate_size, gen));
}

Tensor LlamaBlock::forward(const Tensor& x) {
  Tensor h = add(x, self_attn_(input_layernorm_(x)));
  return add(h, mlp_(post_attention_layernorm_(h)));
}

}  // namespace acc::nn
