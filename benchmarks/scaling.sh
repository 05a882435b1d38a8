#!/usr/bin/env bash
# Data-parallel scaling, AutoAcc and PyTorch DDP side by side in the same run.
#
#   benchmarks/scaling.sh [--build DIR] [--config gpt17m] [--steps 6] [--rounds 2]
#
# For np = 1 and np = 2 (one thread per rank, the same batch per rank): tokens/s of every AutoAcc
# strategy and of PyTorch DDP (gloo), and the fraction of a step's time its communication leaves
# exposed at np = 2. AutoAcc's is measured from outside the strategies: the time the slowest rank
# spends blocked in Work::wait over its step time (acc::dist::wait_seconds, bench_scaling.cpp).
# PyTorch has no such counter, so its np = 2 run interleaves synchronised steps with no_sync()
# steps and reports 1 - t(no_sync) / t(sync) (torch_ddp.py --alternate; 2 x --steps timed steps,
# half of them synchronised). Runs alternate AutoAcc and PyTorch, --rounds times; the figures are
# medians over the rounds. One JSON line per implementation and strategy on stdout; every run's
# output is kept in --out.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
BUILD="$ROOT/build-bench"
CONFIG=gpt17m
STEPS=6
ROUNDS=2
OUT="$(mktemp -d /tmp/acc-scaling.XXXXXX)"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) BUILD="$2"; shift 2 ;;
    --config) CONFIG="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --rounds) ROUNDS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
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

acc_run() {  # np, steps, extra flags, output
  mpirun -np "$1" --oversubscribe --bind-to none "$BENCH" --config "$CONFIG" --strategies "$STRATS" \
    --steps "$2" $3 > "$4"
}
torch_run() {  # np, steps, extra flags, output
  local port=$((29500 + RANDOM % 500)) pids=()
  for ((r = 0; r < $1; r++)); do
    RANK=$r WORLD_SIZE=$1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      timeout 1800 /usr/bin/python3 "$HERE/reference/torch_ddp.py" --config "$CONFIG" --steps "$2" $3 \
      > "$4.r$r" 2> "$4.err.r$r" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  cat "$4.r0" > "$4"
}

for ((round = 0; round < ROUNDS; round++)); do
  echo "scaling.sh: round $round: np=1: AutoAcc" >&2
  acc_run 1 "$STEPS" "" "$OUT/acc.np1.$round.jsonl"
  echo "scaling.sh: round $round: np=1: PyTorch DDP" >&2
  torch_run 1 "$STEPS" "" "$OUT/torch.np1.$round.jsonl"
  echo "scaling.sh: round $round: np=2: AutoAcc" >&2
  acc_run 2 "$STEPS" "" "$OUT/acc.np2.$round.jsonl"
  echo "scaling.sh: round $round: np=2 (sync and no_sync steps interleaved): PyTorch DDP" >&2
  torch_run 2 $((2 * STEPS)) "--alternate" "$OUT/torch.np2.$round.jsonl"
done

/usr/bin/python3 - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def load(path):
    return [json.loads(l) for l in open(path) if l.strip()]
runs = {}  # (impl, strategy, np) -> [result per round]
for impl in ("acc", "torch"):
    for np_ in (1, 2):
        for r in range(rounds):
            for res in load(f"{out}/{impl}.np{np_}.{r}.jsonl"):
                runs.setdefault((impl, res.get("strategy", "ddp"), np_), []).append(res)
def med(results, key):
    return statistics.median(x[key] for x in results)
for impl, strat in sorted({(i, s) for i, s, _ in runs}):
    one, two = runs[(impl, strat, 1)], runs[(impl, strat, 2)]
    line = {"impl": "autoacc" if impl == "acc" else "pytorch_ddp_gloo", "strategy": strat,
            "rounds": rounds,
            "tokens_per_s_np1": round(med(one, "tokens_per_s"), 1),
            "tokens_per_s_np2": round(med(two, "tokens_per_s"), 1),
            "step_ms_np2": round(med(two, "median_step_ms"), 1),
            "exposed_comm_np2": round(med(two, "exposed_comm"), 3),
            "exposed_comm_np2_per_round": [round(x["exposed_comm"], 3) for x in two],
            "exposed_comm_method": "wait_seconds" if impl == "acc" else "no_sync_alternate"}
    print(json.dumps(line), flush=True)
PY
echo "scaling.sh: runs in $OUT" >&2
