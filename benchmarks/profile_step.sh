#!/usr/bin/env bash
# Where the time of a training step goes: perf profile of bench_train, grouped by component.
#
#   benchmarks/profile_step.sh [--build DIR] [--config gpt17m] [--threads 1] [--steps 6]
#
# Runs `perf record -g` over bench_train (1 warm-up step, --steps measured steps, the sgemm peak
# measurement skipped so only model init and training are sampled), then prints a Markdown table
# of `perf report --no-children --sort symbol` grouped into components, with each component's
# share of the training samples (the seeded weight init is left out) and its milliseconds per
# step (share x median step time). The raw report
# stays in the output directory (printed on stderr). Needs perf (Debian: linux-perf).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
BUILD="$ROOT/build-bench"
CONFIG=gpt17m
THREADS=1
STEPS=6
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build) BUILD="$2"; shift 2 ;;
    --config) CONFIG="$2"; shift 2 ;;
    --threads) THREADS="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "profile_step.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
BENCH="$BUILD/benchmarks/bench_train"
command -v perf > /dev/null || { echo "profile_step.sh: perf not found (apt-get install linux-perf)" >&2; exit 1; }
[[ -x "$BENCH" ]] || { echo "profile_step.sh: $BENCH not found; make -C $BUILD bench_train" >&2; exit 1; }

OUT="$(mktemp -d /tmp/autoacc-profile.XXXXXX)"
echo "profile_step.sh: perf data and report in $OUT" >&2
OPENBLAS_NUM_THREADS="$THREADS" ACC_LOG_LEVEL=warn perf record -q -g -o "$OUT/perf.data" \
  "$BENCH" --config "$CONFIG" --threads "$THREADS" --warmup 1 --steps "$STEPS" --sgemm-reps 0 \
  --json-out "$OUT/bench.json" > /dev/null
perf report -i "$OUT/perf.data" --no-children --sort symbol --stdio -g none --percent-limit 0 \
  2> /dev/null > "$OUT/report.txt"

/usr/bin/python3 - "$OUT/report.txt" "$OUT/bench.json" <<'EOF'
import json, re, sys
report, bench = sys.argv[1], json.load(open(sys.argv[2]))
# (component, regex over the symbol); first match wins
groups = [
    ("GEMM: OpenBLAS sgemm micro-kernel", r"sgemm_kernel"),
    ("GEMM: OpenBLAS packing/copies and driver", r"^sgemm_|^sgemv|blas_|gemm_thread|exec_blas|inner_thread"),
    ("attention backward (fused kernel)", r"attention_backward"),
    ("attention forward (fused kernel)", r"attention_forward"),
    ("attention reference path (softmax)", r"softmax"),
    ("expf/logf (attention, cross-entropy, gelu)", r"__expf|__logf|__tanhf|expf|logf|tanhf"),
    ("layernorm / rmsnorm", r"layernorm|rmsnorm|layer_norm|rms_norm"),
    ("gelu / silu / swiglu", r"gelu|silu|swiglu"),
    ("rotary embedding", r"rope"),
    ("cross-entropy (fused)", r"cross_entropy"),
    ("embedding fwd/bwd", r"embedding"),
    ("AdamW + grad clipping", r"adam|clip_grad|grad_norm|sum_squares|optim::"),
    ("elementwise, broadcast, copies (residual adds, bias grads, contiguous)",
     r"binary|for_each_row|copy_rows|sum_to|axpy|kernels::scale|kernels::sum|add_|memmove|memcpy|memset"),
    ("weight init (discarded: --init-from is not used here)", r"philox|normal_|uniform_|sincos|fill_with"),
    ("autograd engine, tensor bookkeeping, allocator", r"acc::|std::|operator new|malloc|free|tbb"),
    ("kernel (page faults, scheduling)", r"^\[k\]"),
]
rows = {}
other = []
for line in open(report):
    m = re.match(r"\s*([\d.]+)%\s+(\[[.k]\])\s+(.*)$", line)
    if not m:
        continue
    pct, kind, sym = float(m.group(1)), m.group(2), m.group(3).strip()
    key = sym if kind == "[.]" else "[k] " + sym
    for name, rx in groups:
        if re.search(rx, key):
            rows[name] = rows.get(name, 0.0) + pct
            break
    else:
        rows["other"] = rows.get("other", 0.0) + pct
        other.append((pct, sym))
step = bench["median_step_ms"]
init_name = next(n for n, _ in groups if n.startswith("weight init"))
init_pct = rows.pop(init_name, 0.0)
train_pct = sum(rows.values())  # samples of everything but the discarded init
print(f"{bench['config']}, {bench['threads']} thread(s), median step {step:.0f} ms "
      f"({bench['tokens_per_s']:.0f} tokens/s), {bench['model_flops_per_step'] / 1e9:.1f} GFLOP "
      f"per step ({bench['achieved_gflops']:.1f} GFLOP/s)\n")
print("| component | % of step | ms per step |")
print("|---|---:|---:|")
for name, pct in sorted(rows.items(), key=lambda kv: -kv[1]):
    share = pct / train_pct
    if share >= 0.0005:
        print(f"| {name} | {100 * share:.1f} | {share * step:.0f} |")
print(f"\n(shares exclude the {init_pct:.1f}% of samples spent in the discarded seeded init)")
if rows.get("other", 0.0) >= 0.5:
    top = ", ".join(f"{s[:60]} {p:.2f}%" for p, s in sorted(other, reverse=True)[:5])
    print(f"\nlargest 'other' symbols: {top}")
EOF
