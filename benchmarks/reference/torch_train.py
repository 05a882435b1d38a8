#!/usr/bin/python3
"""PyTorch side of AutoAcc's training benchmark: the same model, weights, tokens and step as
benchmarks/bench_train, in plain eager PyTorch: the reference GPT and Llama of
tests/golden/models.py (the models the golden tests are generated with) with the fastest attention
this torch has (models.set_attention, --attention).

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
    import torch.nn.functional as F
except ImportError:
    sys.exit("torch_train.py: this Python has no torch; run it with /usr/bin/python3 "
             "(apt-get install python3-torch)")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "golden"))
sys.dont_write_bytecode = True
import models  # noqa: E402  (the reference GPT and Llama, shared with the golden tests)
import safetensors_io  # noqa: E402  (hand-written reader, no `safetensors` package needed)


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
    ap.add_argument("--attention", choices=models.ATTENTION_IMPLS, default="auto",
                    help="auto: sdpa if this torch has it, else baddbmm (models.set_attention)")
    ap.add_argument("--json-out", help="also write the JSON object to this file")
    a = ap.parse_args()

    try:
        attention = models.set_attention(a.attention)
    except ValueError as e:
        sys.exit(f"torch_train.py: {e}")
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
    model = models.build(kind, cfg)
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
        "attention": {"sdpa": "sdpa", "masked": "masked_fill+softmax",
                      "baddbmm": "baddbmm+softmax+bmm"}[attention],
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
