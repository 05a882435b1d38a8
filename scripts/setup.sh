#!/usr/bin/env bash
# Shared by scripts/demo and scripts/test: installs the Debian packages AutoAcc needs (only the
# missing ones), then configures and builds into build/ (Release, ccache, Ninja, -j2).
set -euo pipefail

ACC_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ACC_BUILD="${ACC_BUILD:-$ACC_ROOT/build}"
ACC_JOBS="${ACC_JOBS:-2}"
# ccache in depend mode: a miss runs the compiler once and takes the included files from its -MD
# output, where the default mode first runs the preprocessor to hash them. On a fresh clone every
# compile is a miss, and that pass cost 1.4 s of search/dry_run.cpp's 7.1 s (8.5 s against 7.2 s
# in depend mode, three runs each, 2026-11-29): about a fifth of each build tree. Hits are found
# as in direct mode. CCACHE_NODEPEND=1 turns it off.
[ -n "${CCACHE_NODEPEND:-}" ] || export CCACHE_DEPEND=1

# clang-format: the suite's format_check (tests/CMakeLists.txt) runs only where it is installed.
acc_packages=(
  g++ cmake make ninja-build pkg-config ccache python3
  openmpi-bin libopenmpi-dev libopenblas-dev libboost-graph-dev libtbb-dev
  nlohmann-json3-dev libspdlog-dev libzstd-dev libcli11-dev libxxhash-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libgoogle-perftools-dev
  iproute2 coreutils
  clang-format
)
# Only for scripts/test's fuzz stage: clang and its libFuzzer runtime (libclang_rt.fuzzer).
acc_fuzz_packages=(clang libclang-rt-dev)

acc_install() {
  local want=("$@") missing=()
  for p in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "[setup] installing: ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
}

# Configures the tree $1 from the repository with the CMake arguments that follow. A new tree uses
# Ninja: it compiles a target's objects while the libraries it links are still compiling, where
# Makefiles wait for each library to be linked first. The sanitizer tree of scripts/test, cold and
# without ccache on the 2-vCPU VM, took 521 s with Makefiles and 436 s with Ninja for the same
# CPU time (2026-11-29). A tree configured before keeps its generator (CMake refuses a change).
acc_configure() {
  local dir="$1" generator=()
  shift
  [ -f "$dir/CMakeCache.txt" ] || generator=(-G Ninja)
  cmake -S "$ACC_ROOT" -B "$dir" "${generator[@]}" "$@" >/dev/null
}

acc_build() {
  export CCACHE_DIR="${CCACHE_DIR:-$ACC_ROOT/.cache/ccache}"
  acc_configure "$ACC_BUILD" -DCMAKE_BUILD_TYPE=Release "$@"
  cmake --build "$ACC_BUILD" -j "$ACC_JOBS"
}

# MPI as root needs these; every multi-process run in this repository goes through mpirun.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
