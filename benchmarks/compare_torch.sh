#!/usr/bin/env bash
# AutoAcc vs PyTorch training throughput, side by side in the same run.
#
#   benchmarks/compare_torch.sh [--build DIR] [--out DIR] [--configs "gpt17m gpt90m llama17m"]
#                               [--threads "1 2"] [--rounds 3] [--quick]
#
# For every config and thread count: bench_train writes the initial weights and the tokens once,
# then AutoAcc and PyTorch runs alternate (A,T,A,T,...; --rounds of each) so that machine noise
# hits both alike, and the median tokens/s of each side gives the ratio. Both get the same number
# of cores, each in its best setting: AutoAcc --threads N; PyTorch at 1 core intra-op 1 +
# OpenBLAS 1, at 2 cores the fastest of (intra-op 2, OpenBLAS 1), (1, 2) and (2, 2), measured per
# config by one short run each. One JSON line per (config, threads) on stdout; every run's own JSON
# is kept in --out. PyTorch is Debian's python3-torch under /usr/bin/python3; when it is missing
# the script installs it with apt-get as root, and otherwise says how.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
BUILD="$ROOT/build-bench"
OUT=""
CONFIGS="gpt17m gpt90m llama17m"
THREADS="1 2"
ROUNDS=3
QUICK=0
PY=/usr/bin/python3

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) BUILD="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --configs) CONFIGS="$2"; shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    --rounds) ROUNDS="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "compare_torch.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

BENCH="$BUILD/benchmarks/bench_train"
TORCH_TRAIN="$HERE/reference/torch_train.py"
if [[ ! -x "$PY" ]] || ! "$PY" -c "import torch" 2>/dev/null; then
  if [[ $(id -u) == 0 ]] && command -v apt-get > /dev/null; then
    echo "compare_torch.sh: installing Debian's PyTorch (apt-get install python3-torch)" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-torch >&2
  fi
  if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "compare_torch.sh: $PY has no torch; install Debian's PyTorch with:" \
         "apt-get install python3-torch" >&2
    exit 1
  fi
fi
if [[ ! -x "$BENCH" ]]; then
  echo "compare_torch.sh: $BENCH not found; build it with:" \
       "cmake -S $ROOT -B $BUILD && cmake --build $BUILD -j2 --target bench_train" >&2
  exit 1
fi
if [[ ! "$ROUNDS" =~ ^[1-9][0-9]*$ ]]; then
  echo "compare_torch.sh: --rounds must be a positive integer, got '$ROUNDS'" >&2
  exit 2
fi
[[ -n "$OUT" ]] || OUT="$(mktemp -d /tmp/autoacc-compare.XXXXXX)"
mkdir -p "$OUT"
: > "$OUT/summary.jsonl"  # this run's lines only (an --out reused from an earlier run kept its)
echo "compare_torch.sh: results in $OUT" >&2

# Steps per run: enough to take a median, few enough that the whole script stays under ~28
# minutes on 2 cores (one step of the 90M GPT takes seconds at 1 thread).
steps_for() {  # config -> "warmup steps"
  if [[ $QUICK == 1 ]]; then echo "1 2"; return; fi
  case "$1" in
    gpt90m) echo "1 4" ;;
    *) echo "1 5" ;;
  esac
}

run_acc() {  # config threads warmup steps outfile
  OPENBLAS_NUM_THREADS="$2" ACC_NUM_THREADS="$2" ACC_LOG_LEVEL=warn "$BENCH" --config "$1" \
    --threads "$2" --warmup "$3" --steps "$4" \
    --init-from "$OUT/$1.init.safetensors" --data "$OUT/$1.tokens.u16" --json-out "$5" > /dev/null
}
run_torch() {  # config intraop openblas warmup steps outfile
  OMP_NUM_THREADS="$2" OPENBLAS_NUM_THREADS="$3" "$PY" "$TORCH_TRAIN" \
    --init "$OUT/$1.init.safetensors" --data "$OUT/$1.tokens.u16" --threads-intraop "$2" \
    --warmup "$4" --steps "$5" --json-out "$6" > /dev/null
}
tps() { "$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["tokens_per_s"])' "$1"; }

start=$(date +%s)
for cfg in $CONFIGS; do
  # initial weights and tokens, written once, read by every run of both sides
  ACC_LOG_LEVEL=warn "$BENCH" --config "$cfg" --write-only \
    --write-init "$OUT/$cfg.init.safetensors" --write-data "$OUT/$cfg.tokens.u16"
  read -r warmup steps < <(steps_for "$cfg")
  for n in $THREADS; do
    # PyTorch's best setting for n cores
    if [[ $n == 1 ]]; then
      setting="1 1"
    else
      best=0
      setting=""
      for s in "$n 1" "1 $n" "$n $n"; do
        read -r io ob <<< "$s"
        f="$OUT/$cfg.t$n.probe.io$io.ob$ob.json"
        run_torch "$cfg" "$io" "$ob" 1 2 "$f"
        v=$(tps "$f")
        echo "compare_torch.sh: $cfg $n cores: torch intraop=$io openblas=$ob: $v tokens/s" >&2
        if "$PY" -c 'import sys; sys.exit(0 if float(sys.argv[1]) > float(sys.argv[2]) else 1)' \
             "$v" "$best"; then
          best=$v
          setting="$s"
        fi
      done
    fi
    read -r io ob <<< "$setting"
    for ((r = 0; r < ROUNDS; r++)); do
      run_acc "$cfg" "$n" "$warmup" "$steps" "$OUT/$cfg.t$n.acc.$r.json"
      run_torch "$cfg" "$io" "$ob" "$warmup" "$steps" "$OUT/$cfg.t$n.torch.$r.json"
      echo "compare_torch.sh: $cfg $n cores round $r: acc $(tps "$OUT/$cfg.t$n.acc.$r.json")," \
           "torch $(tps "$OUT/$cfg.t$n.torch.$r.json") tokens/s" >&2
    done
    "$PY" - "$OUT" "$cfg" "$n" "$ROUNDS" "intraop=$io,openblas=$ob" <<'EOF' | tee -a "$OUT/summary.jsonl"
import json, statistics, sys
out, cfg, n, rounds, setting = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
load = lambda side: [json.load(open(f"{out}/{cfg}.t{n}.{side}.{r}.json")) for r in range(rounds)]
acc, torch = load("acc"), load("torch")
med = lambda runs, k: statistics.median(r[k] for r in runs)
rmed = lambda runs, k, nd: round(med(runs, k), nd)
a_tps, t_tps = med(acc, "tokens_per_s"), med(torch, "tokens_per_s")
rel = lambda a, b: abs(a - b) / abs(b)
line = {
    "config": cfg, "threads": n,
    "acc_tokens_per_s": round(a_tps, 1), "torch_tokens_per_s": round(t_tps, 1),
    "ratio": round(a_tps / t_tps, 3),
    # mfu: the median step's model FLOP rate over the process's sgemm peak (bench_train.cpp);
    # medians over the rounds
    "acc_mfu": rmed(acc, "mfu", 3),
    "acc_achieved_gflops": rmed(acc, "achieved_gflops", 1),
    "sgemm_gflops": rmed(acc, "sgemm_gflops", 1),
    "sgemm": acc[0]["sgemm"],
    "model_flops_per_step": acc[0]["model_flops_per_step"],
    "acc_max_rss": max(r["max_rss_bytes"] for r in acc),
    "torch_max_rss": max(r["max_rss_bytes"] for r in torch),
    "acc_peak_tracked_bytes": acc[0]["peak_tracked_bytes"],
    "torch_setting": setting,
    "acc_gemm_threading": acc[0].get("gemm_threading"),
    "rounds": rounds, "steps": acc[0]["steps"], "warmup": acc[0]["warmup"],
    "acc_runs_tokens_per_s": [round(r["tokens_per_s"], 1) for r in acc],
    "torch_runs_tokens_per_s": [round(r["tokens_per_s"], 1) for r in torch],
    "acc_runs_mfu": [round(r["mfu"], 3) for r in acc],
    # same weights, same tokens: the losses must agree (fp32 summation order differs)
    "first_loss_rel_diff": float("%.2g" % rel(acc[0]["first_loss"], torch[0]["first_loss"])),
    "last_loss_rel_diff": float("%.2g" % rel(acc[0]["last_loss"], torch[0]["last_loss"])),
}
line["targets"] = {
    "ratio_ge_1": a_tps >= t_tps,
    "rss_le_torch": line["acc_max_rss"] <= line["torch_max_rss"],
}
if cfg in ("gpt17m", "gpt90m") and n == 1:
    line["targets"]["mfu_ge_0.8"] = med(acc, "mfu") >= 0.8
print(json.dumps(line), flush=True)
EOF
  done
done
echo "compare_torch.sh: done in $(( $(date +%s) - start )) s; per-run JSON in $OUT" >&2
