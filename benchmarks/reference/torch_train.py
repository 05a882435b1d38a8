#!/usr/bin/python3
"""PyTorch side of AutoAcc's training benchmark: the same model, weights, tokens and step as
benchmarks/bench_train, in plain eager PyTorch written the way a PyTorch user writes it for speed.

    OPENBLAS_NUM_THREADS=1 /usr/bin/python3 benchmarks/reference/torch_train.py \
        --init /tmp/gpt17m.init.safetensors --data /tmp/gpt17m.u16 --threads-intraop 1

The model type, its config, batch size and sequence length come from the metadata that
`bench_train --write-init` stores in the safetensors file (override with --batch-size/--seq-len),
so both programs run exactly the same config. Tokens are read as raw little-endian u16 (or u32)
and cut into the same --data-order sequential windows as AutoAcc: sample b of step s starts at
((s*B + b)*T) mod (N - T).

Step (timed; batch assembly is not): opt.zero_grad(set_to_none=True), loss = cross_entropy(
model(idx), targets), loss.backward(), clip_grad_norm_(params, 1.0), AdamW(lr 1e-3, betas
0.9/0.95, eps 1e-8, weight_decay 0.1, every parameter, foreach per --foreach).

Threads: --threads-intraop sets torch.set_num_threads (ATen's OpenMP pool). Debian's torch does
its GEMMs in OpenBLAS (pthreads), whose thread count comes from OPENBLAS_NUM_THREADS at load
time; the value OpenBLAS really uses is read back through ctypes and reported.

Prints one JSON object (the fields bench_train prints where they apply).
"""

import argparse
import ctypes
import json
import math
import os
import resource
import statistics
import sys
import time

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    sys.exit("torch_train.py: this Python has no torch; run it with /usr/bin/python3 "
             "(apt-get install python3-torch)")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "golden"))
sys.dont_write_bytecode = True
import safetensors_io  # noqa: E402  (hand-written reader, no `safetensors` package needed)

HAS_SDPA = hasattr(F, "scaled_dot_product_attention")  # torch >= 2.0


# ----------------------------------------------------------------------------- attention

class CausalMask:
    """Additive (T, T) mask, 0 on and below the diagonal and -inf above, built once per T."""

    def __init__(self):
        self.cache = {}

    def __call__(self, T):
        if T not in self.cache:
            m = torch.full((T, T), float("-inf")).triu_(1)
            self.cache[T] = m
        return self.cache[T]


_MASK = CausalMask()


ATTENTION = "auto"  # set from --attention


def causal_attention(q, k, v):
    """q, k, v: (B, NH, T, HS) -> (B, NH, T, HS). torch >= 2.0: the fused
    F.scaled_dot_product_attention. torch 1.13 has none, so by default one baddbmm computes
    mask + scale * q k^T (mask and scale fused into the GEMM's output pass), then softmax and a
    batched matmul with v; "masked" is nanoGPT's slow path (matmul, scale, masked_fill)."""
    if HAS_SDPA and ATTENTION in ("auto", "sdpa"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    B, NH, T, HS = q.shape
    if ATTENTION == "masked":
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(HS))
        att = att.masked_fill(_MASK(T) != 0, float("-inf"))
        return F.softmax(att, dim=-1) @ v
    att = torch.baddbmm(_MASK(T), q.reshape(B * NH, T, HS), k.reshape(B * NH, T, HS).transpose(1, 2),
                        beta=1.0, alpha=1.0 / math.sqrt(HS))
    att = F.softmax(att, dim=-1)
    return torch.bmm(att, v.reshape(B * NH, T, HS)).view(B, NH, T, HS)


# ----------------------------------------------------------------------------- GPT (nanoGPT names)

class GPTAttention(nn.Module):
    def __init__(self, C, n_head, bias):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(C, 3 * C, bias=bias)
        self.c_proj = nn.Linear(C, C, bias=bias)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        y = causal_attention(q, k, v).transpose(1, 2).reshape(B, T, C)
        return self.c_proj(y)


def layer_norm(C, bias):
    if bias:
        return nn.LayerNorm(C, eps=1e-5)
    ln = nn.LayerNorm(C, eps=1e-5)  # torch 1.13's LayerNorm cannot drop only the bias
    ln.bias = None
    return ln


class GPTBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, bias = cfg["n_embd"], cfg["bias"]
        self.ln_1 = layer_norm(C, bias)
        self.attn = GPTAttention(C, cfg["n_head"], bias)
        self.ln_2 = layer_norm(C, bias)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(C, 4 * C, bias=bias)
        self.mlp.c_proj = nn.Linear(4 * C, C, bias=bias)
        self.approximate = "tanh" if cfg.get("activation", "gelu_tanh") == "gelu_tanh" else "none"

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        h = F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate=self.approximate)
        return x + self.mlp.c_proj(h)


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if cfg.get("dropout", 0.0):
            raise ValueError("torch_train.py: benchmark configs have no dropout")
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg["vocab_size"], cfg["n_embd"]),
            wpe=nn.Embedding(cfg["block_size"], cfg["n_embd"]),
            h=nn.ModuleList([GPTBlock(cfg) for _ in range(cfg["n_layer"])]),
            ln_f=layer_norm(cfg["n_embd"], cfg["bias"]),
        ))
        self.register_buffer("pos", torch.arange(cfg["block_size"]), persistent=False)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.transformer.wte(idx) + self.transformer.wpe(self.pos[:T])
        for block in self.transformer.h:
            x = block(x)
        return F.linear(self.transformer.ln_f(x), self.transformer.wte.weight)  # tied head


# ----------------------------------------------------------------------------- Llama (HF names)

class RMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm (torch 1.13 has no fused RMSNorm)."""

    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C = cfg["hidden_size"]
        self.nh = cfg["num_attention_heads"]
        self.nkv = cfg.get("num_key_value_heads", self.nh)
        self.hd = cfg.get("head_dim", C // self.nh)
        self.q_proj = nn.Linear(C, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(C, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(C, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, C, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.nh // self.nkv
        if rep > 1:  # HF repeat_kv: query head h reads kv head h // rep
            k = k[:, :, None].expand(B, self.nkv, rep, T, self.hd).reshape(B, self.nh, T, self.hd)
            v = v[:, :, None].expand(B, self.nkv, rep, T, self.hd).reshape(B, self.nh, T, self.hd)
        y = causal_attention(q, k, v).transpose(1, 2).reshape(B, T, self.nh * self.hd)
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

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if cfg.get("tie_word_embeddings", False):
            raise ValueError("torch_train.py: tied Llama embeddings are not benchmarked")
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.model.layers = nn.ModuleList(
            [LlamaLayer(cfg) for _ in range(cfg["num_hidden_layers"])])
        self.model.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        # rotary tables, computed once (HF default rope, f32)
        hd = self.model.layers[0].self_attn.hd
        theta = cfg.get("rope_theta", 10000.0)
        maxT = cfg.get("max_position_embeddings", 2048)
        inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.outer(torch.arange(maxT).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, idx):
        T = idx.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))


# ----------------------------------------------------------------------------- harness

def openblas_threads():
    """Threads OpenBLAS really uses (the library torch loaded), or None."""
    try:
        lib = ctypes.CDLL("libopenblas.so.0")
        return int(lib.openblas_get_num_threads())
    except (OSError, AttributeError):
        return None


def load_tokens(path, fmt):
    import numpy as np
    dtype = {"u16": "<u2", "u32": "<u4"}[fmt]
    return torch.from_numpy(np.fromfile(path, dtype=dtype).astype("int64"))


def batch_at(tokens, s, B, T):
    """--data-order sequential: sample b of step s starts at ((s*B + b)*T) mod (N - T)."""
    N = tokens.numel()
    starts = torch.tensor([((s * B + b) * T) % (N - T) for b in range(B)])
    pos = starts[:, None] + torch.arange(T)[None, :]
    return tokens[pos], tokens[pos + 1]


def load_init(model, path):
    tensors, _ = safetensors_io.load_file(path)
    params = dict(model.named_parameters())
    missing = [n for n in params if n not in tensors]
    extra = [n for n in tensors if n not in params]
    if missing or extra:
        raise ValueError(f"{path}: missing {missing}, unexpected {extra}")
    with torch.no_grad():
        for n, p in params.items():
            if tuple(tensors[n].shape) != tuple(p.shape):
                raise ValueError(f"{path}: {n} has shape {list(tensors[n].shape)}, model "
                                 f"{list(p.shape)}")
            p.copy_(tensors[n].to(torch.float32))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--init", required=True, help="safetensors written by bench_train --write-init")
    ap.add_argument("--data", required=True, help="tokens written by bench_train --write-data")
    ap.add_argument("--data-format", default="u16", choices=["u16", "u32"])
    ap.add_argument("--threads-intraop", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=0, help="default: from the init metadata")
    ap.add_argument("--seq-len", type=int, default=0, help="default: from the init metadata")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--foreach", choices=["true", "false"], default="false",
                    help="AdamW foreach implementation (measured: see benchmarks/README.md)")
    ap.add_argument("--attention", choices=["auto", "baddbmm", "masked", "sdpa"], default="auto",
                    help="auto: sdpa if this torch has it, else baddbmm")
    ap.add_argument("--json-out", help="also write the JSON object to this file")
    a = ap.parse_args()

    global ATTENTION
    ATTENTION = a.attention
    if a.attention == "sdpa" and not HAS_SDPA:
        sys.exit(f"torch_train.py: torch {torch.__version__} has no scaled_dot_product_attention")
    torch.set_num_threads(a.threads_intraop)
    torch.set_num_interop_threads(1)  # eager CPU training runs no inter-op work

    _, meta = safetensors_io.load_file(a.init)
    for key in ("model_type", "config"):
        if key not in meta:
            sys.exit(f"torch_train.py: {a.init} has no '{key}' metadata; write it with "
                     "bench_train --write-init")
    kind, cfg = meta["model_type"], json.loads(meta["config"])
    B = a.batch_size or int(meta.get("batch_size", 8))
    T = a.seq_len or int(meta.get("seq_len", 256))
    torch.manual_seed(0)
    model = {"gpt": GPT, "llama": Llama}[kind](cfg)
    load_init(model, a.init)
    model.train()
    tokens = load_tokens(a.data, a.data_format)
    if tokens.numel() < T + 1:
        sys.exit(f"torch_train.py: {a.data} has {tokens.numel()} tokens, need {T + 1}")

    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            foreach=a.foreach == "true")
    V = model.transformer.wte.weight.shape[0] if kind == "gpt" else model.lm_head.weight.shape[0]

    step_ms, losses = [], []
    for s in range(a.warmup + a.steps):
        idx, targets = batch_at(tokens, s, B, T)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(idx).view(-1, V), targets.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ms = (time.perf_counter() - t0) * 1e3
        lv = float(loss)
        if not math.isfinite(lv):
            sys.exit(f"torch_train.py: loss became {lv} at step {s}")
        losses.append(lv)
        if s >= a.warmup:
            step_ms.append(ms)

    med = statistics.median(step_ms)
    ob = openblas_threads()
    out = {
        "impl": "pytorch",
        "config": meta.get("bench_config", os.path.basename(a.init)),
        "model": kind,
        "params": sum(p.numel() for p in params),
        "batch": B,
        "seq_len": T,
        "threads": max(a.threads_intraop, ob or 1),
        "threads_intraop": a.threads_intraop,
        "openblas_threads": ob,
        "setting": f"intraop={a.threads_intraop},openblas={ob}",
        "warmup": a.warmup,
        "steps": a.steps,
        "median_step_ms": med,
        "min_step_ms": min(step_ms),
        "tokens_per_s": B * T / (med / 1e3),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "step_ms": step_ms,
        "attention": ("sdpa" if HAS_SDPA and a.attention in ("auto", "sdpa")
                      else "masked_fill+softmax" if a.attention == "masked"
                      else "baddbmm+softmax+bmm"),
        "adamw_foreach": a.foreach == "true",
        "torch_version": torch.__version__,
    }
    line = json.dumps(out)
    print(line, flush=True)
    if a.json_out:
        with open(a.json_out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
