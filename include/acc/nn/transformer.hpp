#pragma once
// Transformer building blocks: GPT-2 style (LayerNorm, fused qkv, GELU MLP) and Llama style
// (RMSNorm, rotary q/k, grouped-query attention, SwiGLU MLP). Parameter names follow nanoGPT and
// Hugging Face Llama respectively. Every block maps (B, T, C) -> (B, T, C), so strategies can wrap
// any of them through Module::operator().
//
// The attentions take their number of heads from their projections, not from the config: the
// head dimension HS is fixed when the attention is built, and each forward divides the widths the
// q/k/v projections give by HS. An attention whose projections were replaced by column shards of
// h_local heads (Module::replace_module) runs with h_local heads, its output projection receiving
// h_local * HS features; head_split.hpp says which rows a shard holds.

#include <functional>
#include <utility>
#include <vector>

#include "acc/nn/layers.hpp"

namespace acc::nn {

enum class Activation { kGeluTanh, kGelu, kRelu, kSilu };
/// "gelu_tanh" | "gelu" | "relu" | "silu"; throws acc::ValueError naming anything else.
Activation parse_activation(const std::string& name);
Tensor activate(const Tensor& x, Activation a);

/// The attention core both attention classes run: q (B, H, T, HS), k and v (B, HKV, T, HS), H a
/// multiple of HKV -> (B, H, T, HS), causal, at the positions the heads were rotated to.
using AttentionCore = std::function<Tensor(const Tensor& q, const Tensor& k, const Tensor& v)>;
/// A wrapper around the core, given the next core inward (the plain one innermost): selective
/// recomputation checkpoints it, Ulysses trades sequence for heads around it.
using AttentionCoreWrapper = std::function<Tensor(const AttentionCore& inner, const Tensor& q,
                                                  const Tensor& k, const Tensor& v)>;

/// What CausalSelfAttention and LlamaAttention share: their core, and the wrappers around it.
class AttentionCoreHooks {
 public:
  virtual ~AttentionCoreHooks() = default;
  /// HS: the features of one head, fixed when the attention is built (what a head split or a
  /// sequence split counts heads by).
  virtual int64_t head_dim() const = 0;
  /// Installs `wrapper` outermost. Returns the undo, which removes it (undo in reverse order).
  Undo wrap_core(AttentionCoreWrapper wrapper);
  /// The plain core: the fused flash attention, or the reference matmul/softmax path.
  void set_fused(bool fused) { fused_ = fused; }

 protected:
  /// The core with every wrapper, outermost first.
  Tensor run_core(const Tensor& q, const Tensor& k, const Tensor& v) const;

 private:
  bool fused_ = true;
  int next_id_ = 0;
  std::vector<std::pair<int, AttentionCoreWrapper>> wrappers_;  // innermost first
};

/// Wraps the core of every CausalSelfAttention and LlamaAttention under `root` (root included)
/// with `wrapper`. Returns the undo of all of them; acc::ValueError when there is none.
Undo wrap_attention_cores(Module& root, const AttentionCoreWrapper& wrapper);

/// GPT-2 causal self-attention: c_attn (3C x C, q|k|v) then fused attention then c_proj.
/// forward: x (B, T, C) -> c_attn -> (B, T, 3 C_local) split into q | k | v of NH_local = C_local /
/// HS heads each -> attention -> (B, T, C_local) -> c_proj. C_local = C and NH_local = n_head as
/// built; a c_attn replaced by a shard of whole heads (nn::fused_qkv_rows) gives fewer.
/// Throws acc::ShapeError when x is not (B, T, C) or c_attn's width is not 3 x a multiple of HS.
class CausalSelfAttention : public Module, public AttentionCoreHooks {
 public:
  CausalSelfAttention(int64_t n_embd, int64_t n_head, bool bias, double dropout = 0.0,
                      Generator& gen = default_generator());
  Tensor forward(const Tensor& x) override;
  /// HS = n_embd / n_head, fixed at construction.
  int64_t head_dim() const override { return head_dim_; }

 private:
  int64_t n_embd_, head_dim_;
  Child<Module> c_attn_, c_proj_;
  Child<Dropout> resid_drop_;
};

/// c_fc (F x C) -> activation -> c_proj (C x F).
class MLP : public Module {
 public:
  MLP(int64_t n_embd, int64_t hidden, bool bias, Activation act, double dropout = 0.0,
      Generator& gen = default_generator());
  Tensor forward(const Tensor& x) override;

 private:
  Activation act_;
  Child<Module> c_fc_, c_proj_;
  Child<Dropout> drop_;
};

/// down_proj(silu(gate_proj(x)) * up_proj(x)), no biases (Llama).
class SwiGLUMLP : public Module {
 public:
  SwiGLUMLP(int64_t hidden_size, int64_t intermediate_size, Generator& gen = default_generator());
  Tensor forward(const Tensor& x) override;

 private:
  Child<Module> gate_proj_, up_proj_, down_proj_;
};

/// Pre-norm GPT block: x + attn(ln_1(x)), then + mlp(ln_2(x)).
class GPTBlock : public Module {
 public:
  GPTBlock(int64_t n_embd, int64_t n_head, bool bias, Activation act, double dropout = 0.0,
           Generator& gen = default_generator());
  Tensor forward(const Tensor& x) override;
  /// Throws acc::TypeError when attn was replaced by a module of another type.
  CausalSelfAttention& attn() { return *attn_; }

 private:
  Child<Module> ln_1_, ln_2_, mlp_;
  Child<CausalSelfAttention> attn_;
};

/// Llama attention: q/k/v/o projections without bias, rotary embeddings on q and k,
/// num_key_value_heads <= num_heads (grouped-query attention).
/// forward: x (B, T, C) -> q_proj (B, T, NH HS), k_proj and v_proj (B, T, NKV HS) -> heads, q and k
/// rotated to positions position_offset + t (current_forward_options()) -> attention ->
/// (B, T, NH HS) -> o_proj. NH and NKV are read from the projections' widths (see above).
/// Throws acc::ShapeError when a width is not a multiple of HS, v's width differs from k's, NH is
/// not a multiple of NKV, or the positions pass the rotary tables (max_position_embeddings).
class LlamaAttention : public Module, public AttentionCoreHooks {
 public:
  /// `rope` holds the (max_positions, head_dim) cos/sin tables from acc::rope_cache, shared by all
  /// layers of a model.
  LlamaAttention(int64_t hidden_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                 std::pair<Tensor, Tensor> rope, Generator& gen = default_generator());
  Tensor forward(const Tensor& x) override;
  int64_t head_dim() const override { return head_dim_; }

  /// Rotary embedding of q or k heads (B, H, T, HS) at positions [offset, offset + T): what
  /// forward applies with offset = current_forward_options().position_offset. Rows of the same
  /// tables, so the heads of a chunk rotated at its offset equal that chunk of the whole sequence
  /// rotated at 0, bitwise. Throws acc::ValueError when offset < 0 or offset + T passes the tables.
  Tensor rotate(const Tensor& heads, int64_t offset) const;

 private:
  int64_t head_dim_;
  Tensor rope_cos_, rope_sin_;
  Child<Module> q_proj_, k_proj_, v_proj_, o_proj_;
};

/// Pre-norm Llama decoder layer: x + self_attn(input_layernorm(x)), then
/// + mlp(post_attention_layernorm(x)).
class LlamaBlock : public Module {
 public:
  LlamaBlock(int64_t hidden_size, int64_t intermediate_size, int64_t num_heads,
             int64_t num_kv_heads, int64_t head_dim, std::pair<Tensor, Tensor> rope,
             double rms_norm_eps, Generator& gen = default_generator());
  Tensor forward(const Tensor& x) override;
  /// Throws acc::TypeError when self_attn was replaced by a module of another type.
  LlamaAttention& self_attn() { return *self_attn_; }

 private:
  Child<Module> input_layernorm_, post_attention_layernorm_, mlp_;
  Child<LlamaAttention> self_attn_;
};

}  // namespace acc::nn
