"""Plain-torch reference models for AutoAcc (no `transformers` needed): the one definition that
the golden tests (make_golden.py, make_train_reference.py) and the PyTorch side of the benchmarks
(benchmarks/reference/torch_train.py, torch_ddp.py) share.

GPT:   GPT-2 / nanoGPT layout, tied embeddings, parameter names as in nanoGPT.
Llama: Hugging Face LlamaForCausalLM layout, RoPE and GQA as in HF, untied lm_head.

Attention is computed the plain way (matmul, scale, masked_fill, softmax, matmul), which the
golden files were generated with; the benchmarks pick a faster one with set_attention().

Dimension letters: B batch, T time, C channels, NH heads, HS head size, V vocab.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


# ----------------------------------------------------------------------------- GPT

GPT_DEFAULTS = dict(n_layer=2, n_head=4, n_embd=32, vocab_size=64, block_size=16, bias=True,
                    activation="gelu_tanh")


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (torch 1.13's nn.LayerNorm cannot drop only the bias)."""

    def __init__(self, n, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


HAS_SDPA = hasattr(F, "scaled_dot_product_attention")  # torch >= 2.0
ATTENTION_IMPLS = ("masked", "baddbmm", "sdpa", "auto")
_attention = "masked"
_additive_masks = {}  # T -> (T, T) additive causal mask, for "baddbmm"


def set_attention(impl):
    """How causal_attention computes: "masked" (the default; the golden files were generated with
    it), "baddbmm" (one baddbmm computes mask + scale * q k^T, the mask and scale fused into the
    GEMM's output pass; the fast path on torch 1.13), "sdpa" (F.scaled_dot_product_attention,
    torch >= 2.0) or "auto" (sdpa when this torch has it, else baddbmm). Returns the one chosen."""
    global _attention
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention {impl!r}, expected one of {ATTENTION_IMPLS}")
    if impl == "auto":
        impl = "sdpa" if HAS_SDPA else "baddbmm"
    if impl == "sdpa" and not HAS_SDPA:
        raise ValueError(f"torch {torch.__version__} has no scaled_dot_product_attention")
    _attention = impl
    return impl


def causal_attention(q, k, v):
    """q, k, v: (B, NH, T, HS) -> (B, NH, T, HS); softmax(q k^T / sqrt(HS)) with causal mask."""
    T, hs = q.size(-2), q.size(-1)
    if _attention == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if _attention == "baddbmm":
        if T not in _additive_masks:
            _additive_masks[T] = torch.full((T, T), float("-inf")).triu_(1)
        B, NH = q.shape[:2]
        att = torch.baddbmm(_additive_masks[T].to(q.dtype), q.reshape(B * NH, T, hs),
                            k.reshape(B * NH, T, hs).transpose(1, 2), beta=1.0,
                            alpha=1.0 / math.sqrt(hs))
        att = F.softmax(att, dim=-1)
        return torch.bmm(att, v.reshape(B * NH, T, hs)).view(B, NH, T, hs)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    att = att.masked_fill(~mask, float("-inf"))
    att = F.softmax(att, dim=-1)
    return att @ v


class GPTAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C = cfg["n_embd"]
        self.n_head = cfg["n_head"]
        self.c_attn = nn.Linear(C, 3 * C, bias=cfg["bias"])
        self.c_proj = nn.Linear(C, C, bias=cfg["bias"])

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        y = causal_attention(q, k, v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class GPTMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C = cfg["n_embd"]
        self.c_fc = nn.Linear(C, 4 * C, bias=cfg["bias"])
        self.c_proj = nn.Linear(4 * C, C, bias=cfg["bias"])
        act = cfg.get("activation", "gelu_tanh")
        if act not in ("gelu_tanh", "gelu"):
            raise ValueError(f"unknown activation {act}")
        self.approximate = "tanh" if act == "gelu_tanh" else "none"

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class GPTBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = LayerNorm(cfg["n_embd"], cfg["bias"])
        self.attn = GPTAttention(cfg)
        self.ln_2 = LayerNorm(cfg["n_embd"], cfg["bias"])
        self.mlp = GPTMLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = dict(GPT_DEFAULTS, **cfg)
        cfg = self.cfg
        if cfg.get("dropout", 0.0):
            raise ValueError("the reference GPT has no dropout")
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg["vocab_size"], cfg["n_embd"]),
            wpe=nn.Embedding(cfg["block_size"], cfg["n_embd"]),
            h=nn.ModuleList([GPTBlock(cfg) for _ in range(cfg["n_layer"])]),
            ln_f=LayerNorm(cfg["n_embd"], cfg["bias"]),
        ))

    def forward(self, idx):
        """idx: (B, T) int64 -> logits (B, T, V)."""
        B, T = idx.shape
        if T > self.cfg["block_size"]:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg['block_size']}")
        pos = torch.arange(T, dtype=torch.long)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return x @ self.transformer.wte.weight.t()  # tied lm head


# ----------------------------------------------------------------------------- Llama

class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.weight


def rotate_half(x):
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), dim=-1)


def rope_cos_sin(T, head_dim, theta):
    """(T, head_dim) cos and sin tables, exactly as HF LlamaRotaryEmbedding (default rope)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(T).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class LlamaAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C = cfg["hidden_size"]
        self.nh = cfg["num_attention_heads"]
        self.nkv = cfg.get("num_key_value_heads", self.nh)
        self.hd = cfg.get("head_dim", C // self.nh)
        self.theta = cfg.get("rope_theta", 10000.0)
        if self.nh % self.nkv != 0:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        self.q_proj = nn.Linear(C, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(C, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(C, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, C, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        cos, sin = rope_cos_sin(T, self.hd, self.theta)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # HF repeat_kv: query head h reads kv head h // (nh / nkv)
        rep = self.nh // self.nkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = causal_attention(q, k, v).transpose(1, 2).contiguous().view(B, T, self.nh * self.hd)
        return self.o_proj(y)


class LlamaMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, H = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(C, H, bias=False)
        self.up_proj = nn.Linear(C, H, bias=False)
        self.down_proj = nn.Linear(H, C, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class LlamaInner(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList([LlamaLayer(cfg) for _ in range(cfg["num_hidden_layers"])])
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))


class Llama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = dict(cfg)
        if cfg.get("tie_word_embeddings", False):
            raise ValueError("the reference Llama has an untied lm_head")
        self.model = LlamaInner(cfg)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)

    def forward(self, idx):
        """idx: (B, T) int64 -> logits (B, T, V)."""
        T = idx.shape[1]
        if T > self.cfg.get("max_position_embeddings", 2048):
            raise ValueError(f"sequence length {T} exceeds max_position_embeddings")
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


# ----------------------------------------------------------------------------- shared

EMBEDDING_STD = 0.2
LINEAR_STD = 0.02


def is_embedding(name):
    return name.endswith(("wte.weight", "wpe.weight", "embed_tokens.weight"))


def is_norm(name):
    leaf = name.rsplit(".", 2)[-2]
    return leaf in ("ln_1", "ln_2", "ln_f", "input_layernorm", "post_attention_layernorm",
                    "norm")


@torch.no_grad()
def init_weights(model, seed, linear_std=LINEAR_STD):
    """Deterministic, deliberately non-trivial init, drawn in named_parameters() order from one
    torch.Generator seeded with `seed`: embeddings N(0, 0.2); other weight matrices
    N(0, linear_std); norm weights 1 + 0.1 N(0,1); norm biases and linear biases 0.1 N(0,1)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        z = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if name.endswith(".bias"):
            p.copy_(0.1 * z)
        elif is_norm(name):
            p.copy_(1.0 + 0.1 * z)
        elif is_embedding(name):
            p.copy_(EMBEDDING_STD * z)
        else:
            p.copy_(linear_std * z)


def build(kind, cfg):
    if kind == "gpt":
        return GPT(cfg)
    if kind == "llama":
        return Llama(cfg)
    raise ValueError(f"unknown model kind {kind}")


def loss_fn(logits, targets):
    V = logits.size(-1)
    return F.cross_entropy(logits.view(-1, V), targets.view(-1))


def train_adamw(model, batches, steps, lr, betas, eps, weight_decay, clip=None):
    """Plain training loop: per step zero_grad, forward, mean CE loss, backward, optional
    clip_grad_norm_(all params, clip), AdamW step (one param group, constant lr).
    `batches(s)` returns (idx, targets) for step s.
    Returns (losses, pre-clip total grad norms); losses[s] is computed before step s's update."""
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                            foreach=False)
    losses, norms = [], []
    for s in range(steps):
        idx, targets = batches(s)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(idx), targets)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        else:
            norms.append(float(torch.norm(torch.stack([p.grad.norm() for p in params]))))
        opt.step()
        losses.append(float(loss))
    return losses, norms
