#!/usr/bin/env python3
"""Searches each row of Narayanan et al.'s Table 1 with acc-search --plan-only and checks the issue's
target: the chosen plan predicted at least as fast as the paper's plan, within the device's memory.

For each row (published/narayanan2021_table1.json): the paper's plan is predicted alone
(--strategy, the plan tests/search/cluster_test.cpp prices: tp and pp as published, micro-batch 1,
the interleaved schedule with 2 stages a rank where a rank's blocks split evenly, every block
recomputed, amp, ddp), then the whole space is searched (amp allowed, AdamW). Prints one
Markdown row per model (the table of search/profiles/README.md) and one JSON object at the end;
exits 1 when a chosen plan is predicted slower than the paper's or over the device's memory.

  search/profiles/search_table1.py --acc-search build/bin/acc-search [--rows 1.7,3.6] [--out DIR]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def gpt_config(layers, heads, hidden, seq):
    # The same model as cluster_test.cpp's gpt_config: Table 1's vocabulary, GELU, biases.
    return {"n_layer": layers, "n_head": heads, "n_embd": hidden, "vocab_size": 51200,
            "block_size": seq, "bias": True, "activation": "gelu"}


def published_plan(layers, tp, pp, virtual, micro_batches):
    # As cluster_test.cpp's published_plan: equal stages of blocks where they split evenly.
    plan = []
    if tp > 1:
        plan.append({"name": "tensor_parallel", "config": {"size": tp}})
    if pp > 1:
        c = {"size": pp, "micro_batches": micro_batches}
        if virtual > 1:
            c["virtual"] = virtual
        stages = pp * virtual
        if layers % stages == 0:
            per = layers // stages
            c["stages"] = [[i * per, i * per + per - 1] for i in range(stages)]
        plan.append({"name": "pipeline_parallel", "config": c})
    elif micro_batches > 1:
        plan.append({"name": "grad_accum", "config": {"steps": micro_batches}})
    plan += [{"name": "checkpoint"}, {"name": "amp"}, {"name": "ddp"}]
    return plan


def plan(acc_search, config_path, gpus, batch, out_path, strategy=None):
    cmd = [acc_search, "--plan-only", "--cluster", os.path.join(HERE, "a100-selene.json"),
           "--world", str(gpus), "--model", "gpt", "--config", config_path,
           "--global-batch", str(batch), "--seq-len", "2048", "--allow-bf16", "--out", out_path]
    if strategy is not None:
        cmd += ["--strategy", json.dumps(strategy)]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    if r.returncode != 0:
        sys.exit(f"search_table1: {' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    with open(out_path) as f:
        return json.load(f), seconds, r.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--acc-search", default="build/bin/acc-search", help="the acc-search binary")
    ap.add_argument("--rows", default="",
                    help="comma-separated model sizes in billions (default: every row)")
    ap.add_argument("--out", default="", help="directory for each row's plans (default: a temp dir)")
    a = ap.parse_args()
    if not os.access(a.acc_search, os.X_OK):
        sys.exit(f"search_table1: --acc-search {a.acc_search!r} is not an executable")
    with open(os.path.join(HERE, "published", "narayanan2021_table1.json")) as f:
        table = json.load(f)
    wanted = {float(x) for x in a.rows.split(",") if x.strip()}
    known = {row[0] for row in table["rows"]}
    unknown = sorted(wanted - known)
    if unknown:
        sys.exit(f"search_table1: --rows {unknown} not in Table 1 (its rows: {sorted(known)})")
    out_dir = a.out or tempfile.mkdtemp(prefix="autoacc-table1.")
    os.makedirs(out_dir, exist_ok=True)
    print("| model | GPUs | batch | chosen plan | predicted step | peak | paper's plan, predicted "
          "(peak) | search |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    results, failed = [], []
    for billions, heads, hidden, layers, tp, pp, gpus, batch, *_ in table["rows"]:
        if wanted and billions not in wanted:
            continue
        dp = gpus // (tp * pp)
        virtual = 2 if pp > 1 and (layers // pp) % 2 == 0 else 1
        tag = f"{billions}B"
        config_path = os.path.join(out_dir, f"{tag}.json")
        with open(config_path, "w") as f:
            json.dump(gpt_config(layers, heads, hidden, 2048), f)
        paper, _, _ = plan(a.acc_search, config_path, gpus, batch,
                           os.path.join(out_dir, f"{tag}-paper.json"),
                           published_plan(layers, tp, pp, virtual, batch // dp))
        chosen, seconds, stdout = plan(a.acc_search, config_path, gpus, batch,
                                       os.path.join(out_dir, f"{tag}-searched.json"))
        step, peak = chosen["predicted"]["time"]["step_s"], chosen["predicted"]["memory"]["peak"]
        # The device's memory as the printout gives it ("peak memory 63.4 GiB of 76.0 GiB").
        m = re.search(r"peak memory [0-9.]+ GiB of ([0-9.]+) GiB", stdout)
        if m is None:
            sys.exit(f"search_table1: no 'peak memory ... of ... GiB' in acc-search's output:\n"
                     f"{stdout[:2000]}")
        capacity = float(m.group(1)) * 2**30
        paper_step = paper["predicted"]["time"]["step_s"]
        paper_peak = paper["predicted"]["memory"]["peak"]
        # The printout rounds the capacity to 0.1 GiB.
        ok = step <= paper_step and peak <= capacity + 0.05 * 2**30
        if not ok:
            failed.append(tag)
        row = {"model": tag, "gpus": gpus, "batch": batch, "chosen": chosen["name"],
               "micro_batch": chosen.get("micro_batch"), "step_s": step, "peak_bytes": peak,
               "capacity_bytes": capacity,
               "paper_step_s": paper_step, "paper_peak_bytes": paper_peak,
               "search_s": round(seconds, 1), "ok": ok}
        results.append(row)
        print(f"| {tag} | {gpus} | {batch} | {row['chosen']} | {step:.2f} s | "
              f"{peak / 2**30:.1f} GiB | {paper_step:.2f} s ({paper_peak / 2**30:.1f} GiB) | "
              f"{seconds:.0f} s |", flush=True)
    print(json.dumps({"rows": results, "failed": failed, "out": out_dir}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
