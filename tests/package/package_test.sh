#!/usr/bin/env bash
# A user's project links the installed AutoAcc (issue 17): installs BUILD into SCRATCH/prefix,
# configures examples/external there with find_package(AutoAcc) (Release, the build's compiler and
# ccache), builds it, runs the app on one thread and checks it printed finite losses. SCRATCH is
# removed before and after. Each stage prints its time; a failed stage prints its output.
#   package_test.sh CMAKE BUILD EXTERNAL_SRC SCRATCH GENERATOR CXX [LAUNCHER]
set -euo pipefail
if (($# < 6)); then
  echo "usage: $0 CMAKE BUILD EXTERNAL_SRC SCRATCH GENERATOR CXX [LAUNCHER]" >&2
  exit 2
fi
cmake=$1 build=$2 src=$3 scratch=$4 generator=$5 cxx=$6 launcher=${7:-}
prefix=$scratch/prefix app_build=$scratch/build
min_steps=3

rm -rf "$scratch"
mkdir -p "$scratch"
trap 'rm -rf "$scratch"' EXIT

fail() {
  echo "package_test: $*" >&2
  exit 1
}
# stage NAME CMD...: runs CMD with its output in SCRATCH/NAME.log, shown only when it fails.
stage() {
  local name=$1 start=$SECONDS
  shift
  if ! "$@" >"$scratch/$name.log" 2>&1; then
    cat "$scratch/$name.log" >&2
    fail "$name failed: $*"
  fi
  echo "package_test: $name: $((SECONDS - start)) s"
}

stage install "$cmake" --install "$build" --prefix "$prefix"
[ -f "$prefix/lib/cmake/AutoAcc/AutoAccConfig.cmake" ] ||
  fail "no lib/cmake/AutoAcc/AutoAccConfig.cmake under $prefix"

configure=("$cmake" -S "$src" -B "$app_build" -G "$generator" -DCMAKE_BUILD_TYPE=Release
  -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
[ -z "$launcher" ] || configure+=(-DCMAKE_CXX_COMPILER_LAUNCHER="$launcher")
stage configure "${configure[@]}"
# The package found must be the one just installed, not one elsewhere on the system.
found=$(sed -n 's/^AutoAcc_DIR:PATH=//p' "$app_build/CMakeCache.txt")
[ "$found" = "$prefix/lib/cmake/AutoAcc" ] ||
  fail "find_package(AutoAcc) took '$found', expected $prefix/lib/cmake/AutoAcc"

stage build "$cmake" --build "$app_build" -j 1

start=$SECONDS
out=$(OPENBLAS_NUM_THREADS=1 ACC_NUM_THREADS=1 "$app_build/app" 2>&1) ||
  fail "app exited with $?: $out"
echo "$out"
echo "package_test: run: $((SECONDS - start)) s"
# A loss printed by %f is digits only when finite ("nan", "inf" otherwise).
losses=$(grep -c '^step ' <<<"$out" || true)
finite=$(grep -cE '^step [0-9]+ loss -?[0-9]+\.[0-9]+$' <<<"$out" || true)
((losses == finite)) || fail "$((losses - finite)) of the app's $losses loss lines are not finite"
((finite >= min_steps)) || fail "the app printed $finite finite losses, expected at least $min_steps"
echo "package_test: $finite finite losses"
