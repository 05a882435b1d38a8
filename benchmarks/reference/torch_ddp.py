#!/usr/bin/python3
"""PyTorch DDP (gloo) throughput on the same model as bench_scaling, for the side-by-side figures.

Launched by hand, one process per rank (Debian's torch 1.13 `torch.distributed.run` fails under
Python 3.11): benchmarks/scaling.sh sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE.

  RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 \\
      /usr/bin/python3 benchmarks/reference/torch_ddp.py --config gpt17m [--alternate]

--alternate interleaves synchronised steps and steps inside DDP's no_sync() (no gradient
all-reduce) in one run, so the machine's noise hits both alike, and reports the exposed-
communication fraction 1 - t(no_sync) / t(sync) from the two medians (PyTorch has no counter of
the time spent waiting for collectives, which is how bench_scaling measures AutoAcc). A step's
time is its slowest rank's (per step, the maximum over ranks). Prints one JSON line on rank 0.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "golden"))
sys.dont_write_bytecode = True
import models  # noqa: E402  (the reference GPT and Llama, shared with the golden tests)

CONFIGS = {
    "gpt17m": ("gpt", "gpt_17m.json"),
    "gpt90m": ("gpt", "gpt_90m.json"),
    "llama17m": ("llama", "llama_d512.json"),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="gpt17m", choices=sorted(CONFIGS))
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--alternate", action="store_true")
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    kind, cfg_file = CONFIGS[args.config]
    root = os.path.dirname(os.path.dirname(HERE))
    with open(os.path.join(root, "examples", "configs", cfg_file)) as f:
        cfg = json.load(f)
    torch.manual_seed(1)
    models.set_attention("auto")
    model = models.build(kind, cfg)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            foreach=False)
    gen = torch.Generator().manual_seed(7 + rank)
    V, B, T = cfg["vocab_size"], args.batch_size, args.seq_len
    times = []  # this rank's timed steps, in order
    skipped = []
    for s in range(args.warmup + args.steps):
        skip = args.alternate and s % 2 == 1
        idx = torch.randint(0, V, (B, T), generator=gen)
        tgt = torch.randint(0, V, (B, T), generator=gen)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if skip:
            with ddp.no_sync():
                loss = F.cross_entropy(ddp(idx).view(-1, V), tgt.view(-1))
                loss.backward()
        else:
            loss = F.cross_entropy(ddp(idx).view(-1, V), tgt.view(-1))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        t = (time.perf_counter() - t0) * 1000
        if s >= args.warmup:
            times.append(t)
            skipped.append(skip)
    # A step of the job ends when its slowest rank ends: per step, the maximum over ranks.
    job = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(job, op=dist.ReduceOp.MAX)
    job = job.tolist()
    by_kind = {k: [t for t, s in zip(job, skipped) if s == k] for k in (False, True)}
    if rank == 0:
        sync_ms, skip_ms = (statistics.median(by_kind[k]) if by_kind[k] else 0.0 for k in (False, True))
        step_ms = sync_ms
        mode = "alternate" if args.alternate else "on"
        out = {"impl": "torch_ddp_gloo", "strategy": "ddp", "config": args.config, "world": world,
               "sync": mode, "batch_per_rank": B, "seq_len": T, "steps": args.steps,
               "median_step_ms": step_ms, "tokens_per_s": B * T * world / (step_ms / 1000)}
        if args.alternate:
            out["median_step_ms_sync_skipped"] = skip_ms
            out["tokens_per_s_sync_skipped"] = B * T * world / (skip_ms / 1000)
            out["exposed_comm"] = 1 - skip_ms / sync_ms
        print(json.dumps(out), flush=True)
    # Leave without tearing the group down: Debian's torch 1.13 can deadlock in
    # ~ProcessGroupGloo at exit (the main thread joins gloo's run-loop thread while holding the
    # GIL that thread waits for; seen once in 12 runs of scaling.sh, a rank left spinning).
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
