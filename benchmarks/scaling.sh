#!/usr/bin/env bash
# Data-parallel scaling, AutoAcc and PyTorch DDP side by side in the same run.
#
#   benchmarks/scaling.sh [--build DIR] [--config gpt17m] [--steps 6]
#
# For np = 1 and np = 2 (one thread per rank, the same batch per rank): tokens/s of every AutoAcc
# strategy and of PyTorch DDP (gloo), each with gradient synchronisation and without it (AutoAcc's
# benchmark-only --skip-sync, PyTorch's no_sync()), and the exposed-communication fraction at
# np = 2, 1 - t(sync skipped) / t(sync). Runs alternate AutoAcc and PyTorch. One JSON line per
# implementation and strategy on stdout; every run's output is kept in --out.
#
# On this machine two single-threaded processes share the floating-point throughput of about one
# core, so tokens/s does not double from np = 1 to np = 2 for anyone; the runtime is judged by its
# exposed communication and against PyTorch.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
BUILD="$ROOT/build"
CONFIG=gpt17m
STEPS=6
OUT="$(mktemp -d /tmp/acc-scaling.XXXXXX)"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) BUILD="$2"; shift 2 ;;
    --config) CONFIG="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "scaling.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
BENCH="$BUILD/benchmarks/bench_scaling"
[[ -x "$BENCH" ]] || { echo "scaling.sh: $BENCH not built (cmake --build $BUILD --target bench_scaling)" >&2; exit 1; }
/usr/bin/python3 -c "import torch" 2>/dev/null || {
  echo "scaling.sh: /usr/bin/python3 has no torch (apt-get install python3-torch)" >&2; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
STRATS=ddp,zero1,zero2,fsdp

acc_run() {  # np, extra flags, output
  mpirun -np "$1" --oversubscribe --bind-to none "$BENCH" --config "$CONFIG" --strategies "$STRATS" \
    --steps "$STEPS" $2 > "$3"
}
torch_run() {  # np, extra flags, output
  local port=$((29500 + RANDOM % 500)) pids=()
  for ((r = 0; r < $1; r++)); do
    RANK=$r WORLD_SIZE=$1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      /usr/bin/python3 "$HERE/reference/torch_ddp.py" --config "$CONFIG" --steps "$STEPS" $2 \
      > "$3.r$r" 2> "$3.err.r$r" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  cat "$3.r0" > "$3"
}

for np in 1 2; do
  for mode in sync skip; do
    flag_acc=""; flag_torch=""
    [[ $mode == skip ]] && { flag_acc="--skip-sync"; flag_torch="--no-sync"; }
    echo "scaling.sh: np=$np $mode: AutoAcc" >&2
    acc_run "$np" "$flag_acc" "$OUT/acc.np$np.$mode.jsonl"
    echo "scaling.sh: np=$np $mode: PyTorch DDP" >&2
    torch_run "$np" "$flag_torch" "$OUT/torch.np$np.$mode.jsonl"
  done
done

/usr/bin/python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def load(path):
    return [json.loads(l) for l in open(path) if l.strip()]
res = {}
for impl in ("acc", "torch"):
    for np_ in (1, 2):
        for mode in ("sync", "skip"):
            for r in load(f"{out}/{impl}.np{np_}.{mode}.jsonl"):
                key = (impl, r.get("strategy", "ddp"))
                res.setdefault(key, {})[(np_, mode)] = r
for (impl, strat), runs in sorted(res.items()):
    s1, s2, k2 = runs.get((1, "sync")), runs.get((2, "sync")), runs.get((2, "skip"))
    line = {"impl": "autoacc" if impl == "acc" else "pytorch_ddp_gloo", "strategy": strat,
            "tokens_per_s_np1": round(s1["tokens_per_s"], 1),
            "tokens_per_s_np2": round(s2["tokens_per_s"], 1),
            "tokens_per_s_np2_sync_skipped": round(k2["tokens_per_s"], 1),
            "step_ms_np2": round(s2["median_step_ms"], 1),
            "step_ms_np2_sync_skipped": round(k2["median_step_ms"], 1),
            "exposed_comm_np2": round(1 - k2["median_step_ms"] / s2["median_step_ms"], 3)}
    print(json.dumps(line), flush=True)
PY
echo "scaling.sh: runs in $OUT" >&2
