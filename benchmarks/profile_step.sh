#!/usr/bin/env bash
# Where the time of a training step goes: perf profile of bench_train, grouped by component.
#
#   benchmarks/profile_step.sh [--build DIR] [--config gpt17m] [--threads 1] [--warmup 1]
#                              [--steps 6]
#
# Starts bench_train and attaches `perf record -g` to it once its log shows the last warm-up step
# done, so the seeded init, the sgemm measurement and the warm-up steps are not sampled (the
# benchmark knows nothing of perf); then prints a Markdown table of
# `perf report --no-children --sort symbol` grouped into components, with each component's
# share of the samples and its milliseconds per step (share x median step time). The raw report
# stays in the output directory (printed on stderr). Needs perf (Debian: linux-perf).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
BUILD="$ROOT/build-bench"
CONFIG=gpt17m
THREADS=1
STEPS=6
WARMUP=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) BUILD="$2"; shift 2 ;;
    --config) CONFIG="$2"; shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --warmup) WARMUP="$2"; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "profile_step.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
BENCH="$BUILD/benchmarks/bench_train"
command -v perf > /dev/null || { echo "profile_step.sh: perf not found (apt-get install linux-perf)" >&2; exit 1; }
[[ -x "$BENCH" ]] || { echo "profile_step.sh: $BENCH not found; cmake --build $BUILD --target bench_train" >&2; exit 1; }
if [[ ! "$WARMUP" =~ ^[1-9][0-9]*$ ]]; then
  echo "profile_step.sh: --warmup must be >= 1 (perf attaches after the last warm-up step)," \
       "got '$WARMUP'" >&2
  exit 2
fi

OUT="$(mktemp -d /tmp/autoacc-profile.XXXXXX)"
echo "profile_step.sh: perf data and report in $OUT" >&2
OPENBLAS_NUM_THREADS="$THREADS" ACC_LOG_LEVEL=debug "$BENCH" --config "$CONFIG" \
  --threads "$THREADS" --warmup "$WARMUP" --steps "$STEPS" --json-out "$OUT/bench.json" \
  > /dev/null 2> "$OUT/bench.log" &
pid=$!
# bench_train logs "<config>: step <s> loss ..." at debug level after each step.
until grep -q ": step $((WARMUP - 1)) loss" "$OUT/bench.log"; do
  if ! kill -0 "$pid" 2> /dev/null; then
    echo "profile_step.sh: bench_train ended before its measured steps:" >&2
    cat "$OUT/bench.log" >&2
    exit 1
  fi
  sleep 0.05
done
perf record -q -g -o "$OUT/perf.data" -p "$pid" > /dev/null 2>&1
wait "$pid"
perf script -i "$OUT/perf.data" -F ip,sym,dso 2> /dev/null > "$OUT/script.txt"
perf report -i "$OUT/perf.data" --no-children --sort symbol --stdio -g none --percent-limit 0 \
  2> /dev/null > "$OUT/report.txt"

/usr/bin/python3 - "$OUT/script.txt" "$OUT/bench.json" <<'EOF'
import json, re, sys
script, bench = sys.argv[1], json.load(open(sys.argv[2]))
# Each sample is charged to the first frame of its call chain (leaf first) that matches a
# component, so a memset or malloc counts for the op that called it (clearing C for beta = 0
# counts as GEMM, the bias fill before a linear's GEMM as the linear). Frames matching `generic`
# are skipped while walking the chain.
generic = (r"memset|memmove|memcpy|^malloc|^free|^cfree|_int_malloc|_int_free|operator new|"
           r"operator delete|tile::|\[unknown\]|^std::vector|tbb::detail|"
           r"^acc::parallel_for<|^acc::detail::for_each_row<|simd::|vec::|kernels::fill_rows")
groups = [
    ("GEMM: OpenBLAS sgemm micro-kernel", r"sgemm_kernel"),
    ("GEMM: OpenBLAS packing, zeroing of C, driver",
     r"^sgemm_|^sgemv|blas_|gemm_thread|exec_blas|inner_thread|^acc::kernels::gemm|"
     r"^acc::kernels::\(anonymous namespace\)::sgemm"),
    ("fused attention backward", r"attention_backward"),
    ("fused attention forward", r"attention_forward"),
    # Shared by both directions; out of line since the prefetch (cfd1824).
    ("fused attention: packing rows of q/k/v/dout (fwd + bwd)", r"packed_rows|load_transposed"),
    ("attention reference path (softmax)", r"softmax"),
    ("layernorm / rmsnorm", r"layernorm|rmsnorm|layer_norm|rms_norm"),
    ("gelu / silu / swiglu", r"gelu|silu|swiglu"),
    ("rotary embedding", r"rope|rotary"),
    ("cross-entropy (fused)", r"cross_entropy"),
    ("embedding fwd/bwd", r"embedding"),
    ("AdamW + grad clipping", r"adam|clip_grad|grad_norm|sum_squares|optim::"),
    ("linear: bias broadcast and bias gradient", r"acc::linear|Linear::forward|add_column_sums"),
    ("residual adds, gradient accumulation, copies",
     r"binary|sum_to|axpy|kernels::scale|kernels::sum|add_|copy_rows|copy_|contiguous|acc::cat|split"),
    ("autograd engine, tensor bookkeeping, allocator", r"acc::|std::|tbb|malloc|free|operator new"),
]
def classify(chain):
    for sym in chain:
        if re.search(generic, sym):
            continue
        for name, rx in groups:
            if re.search(rx, sym):
                return name
    leaf = chain[0] if chain else "?"
    for name, rx in groups:
        if re.search(rx, leaf):
            return name
    return "other: " + leaf[:50]
rows, total = {}, 0
def flush(frames):
    global total
    if not frames:
        return
    total += 1
    if frames[0][1].startswith("[kernel"):
        name = "kernel (page faults, scheduling)"
    else:
        name = classify([f[0] for f in frames if not f[1].startswith("[kernel")])
    rows[name] = rows.get(name, 0) + 1
frames = []
for line in open(script):
    line = line.strip()
    if not line:
        flush(frames)
        frames = []
        continue
    # The dso is the last parenthesised field; C++ symbols contain " (" themselves.
    m = re.match(r"[0-9a-f]+\s+(.*)\s+\(([^()]*)\)$", line)
    if m:
        frames.append((m.group(1), m.group(2)))
flush(frames)
step = bench["median_step_ms"]
print(f"{bench['config']}, {bench['threads']} thread(s), median step {step:.0f} ms "
      f"({bench['tokens_per_s']:.0f} tokens/s), {bench['model_flops_per_step'] / 1e9:.1f} GFLOP "
      f"per step ({bench['achieved_gflops']:.1f} GFLOP/s), {total} samples\n")
print("| component | % of step | ms per step |")
print("|---|---:|---:|")
for name, n in sorted(rows.items(), key=lambda kv: -kv[1]):
    share = n / max(total, 1)
    if share >= 0.0005:
        print(f"| {name} | {100 * share:.1f} | {share * step:.0f} |")
EOF
