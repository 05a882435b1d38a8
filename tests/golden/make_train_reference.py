#!/usr/bin/python3
"""Reference for the acceptance test: a model loaded from a PyTorch-written safetensors file,
trained with --data-order sequential, reproduces PyTorch's per-step losses.

Run from anywhere:  /usr/bin/python3 tests/golden/make_train_reference.py
Writes into train_ref/ next to this script:
  tokens.u16.bin           byte-level tokens (raw little-endian uint16, vocab 256) of English text
  <model>.config.json      model config
  <model>.init.safetensors initial weights (F32, model parameter names)
  <model>.losses.json      training hyperparameters and the 20 per-step losses
  <model>.meta.json        extra diagnostics: pre-clip grad norms, fp64 losses, seeds
"""

import copy
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "train_ref")
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True  # keep __pycache__ out of the source tree

import models  # noqa: E402
import safetensors_io  # noqa: E402

INIT_SEED = 4321
NUM_TOKENS = 20000
TEXT_SOURCE = "/usr/share/games/fortunes/fortunes"
TRAIN = {"steps": 20, "batch_size": 4, "seq_len": 32, "lr": 3e-3, "beta1": 0.9, "beta2": 0.95,
         "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 1.0}
# GPT-2's usual init; these runs only have to agree on losses, not to expose kernel bugs
LINEAR_STD = 0.02

CONFIGS = {
    "gpt": dict(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=32, bias=True,
                activation="gelu_tanh"),
    "llama": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=32),
}


def load_tokens():
    """First NUM_TOKENS bytes of the Debian fortunes file. Without that file, fall back to the
    committed tokens.u16.bin so regeneration reproduces the committed losses."""
    if os.path.exists(TEXT_SOURCE):
        with open(TEXT_SOURCE, "rb") as f:
            data = f.read(NUM_TOKENS)
        if len(data) != NUM_TOKENS:
            raise RuntimeError(f"{TEXT_SOURCE}: only {len(data)} bytes, need {NUM_TOKENS}")
        return torch.tensor(list(data), dtype=torch.int64)
    committed = os.path.join(OUT, "tokens.u16.bin")
    if os.path.exists(committed):
        with open(committed, "rb") as f:
            raw = bytearray(f.read())
        return torch.frombuffer(raw, dtype=torch.int16).to(torch.int64) & 0xFFFF
    raise RuntimeError(f"neither {TEXT_SOURCE} nor {committed} exists")


def sequential_batch(tokens, s, B, T):
    """Sample b of step s is the window starting at ((s*B + b)*T) mod (N - T)."""
    N = tokens.numel()
    starts = [((s * B + b) * T) % (N - T) for b in range(B)]
    x = torch.stack([tokens[p:p + T] for p in starts])
    y = torch.stack([tokens[p + 1:p + T + 1] for p in starts])
    return x, y


def train(model, tokens):
    B, T = TRAIN["batch_size"], TRAIN["seq_len"]
    return models.train_adamw(
        model, lambda s: sequential_batch(tokens, s, B, T), TRAIN["steps"], lr=TRAIN["lr"],
        betas=(TRAIN["beta1"], TRAIN["beta2"]), eps=TRAIN["eps"],
        weight_decay=TRAIN["weight_decay"], clip=TRAIN["grad_clip"])


def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    os.makedirs(OUT, exist_ok=True)
    tokens = load_tokens()
    assert int(tokens.max()) < 256
    with open(os.path.join(OUT, "tokens.u16.bin"), "wb") as f:
        f.write(tokens.to(torch.int16).numpy().astype("<u2").tobytes())

    for kind, cfg in CONFIGS.items():
        torch.manual_seed(INIT_SEED)
        model = models.build(kind, cfg)
        models.init_weights(model, INIT_SEED, linear_std=LINEAR_STD)
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        model64 = copy.deepcopy(model).double()

        path = os.path.join(OUT, kind + ".init.safetensors")
        metadata = {"format": "autoacc-train-ref-v1", "model": kind, "config": json.dumps(cfg),
                    "init_seed": str(INIT_SEED), "linear_std": str(LINEAR_STD),
                    "embedding_std": str(models.EMBEDDING_STD)}
        safetensors_io.save_file(init, path, metadata)
        back, meta_back = safetensors_io.load_file(path)
        assert list(back) == list(init) and meta_back == metadata
        for n, t in init.items():
            assert back[n].dtype == torch.float32 and torch.equal(back[n], t), n

        losses, norms = train(model, tokens)
        losses64, _ = train(model64, tokens)
        assert losses[-1] < losses[0], f"{kind}: losses do not decrease: {losses}"

        with open(os.path.join(OUT, kind + ".config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
        with open(os.path.join(OUT, kind + ".losses.json"), "w") as f:
            json.dump(dict(TRAIN, losses=losses), f, indent=2)
            f.write("\n")
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, losses64))
        meta = {"model": kind, "config": cfg, "train": TRAIN, "data_order": "sequential",
                "num_tokens": tokens.numel(), "text_source": TEXT_SOURCE,
                "init_seed": INIT_SEED,
                "init": {"embedding_std": models.EMBEDDING_STD, "linear_std": LINEAR_STD,
                         "norm_weight": "1 + 0.1*N(0,1)", "bias": "0.1*N(0,1)"},
                "grad_norms_before_clip": norms, "losses_fp64": losses64,
                "fp32_vs_fp64_losses_max_rel": rel, "torch_version": torch.__version__}
        with open(os.path.join(OUT, kind + ".meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
        print(f"{kind}: losses {losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"grad norms {min(norms):.3f}..{max(norms):.3f}, fp32 vs fp64 max rel {rel:.2e}, "
              f"{os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
