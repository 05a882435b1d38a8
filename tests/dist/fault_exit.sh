#!/usr/bin/env bash
# Runs `fault_exit MODE` under mpirun -np 2 and passes when every rank printed "rank R: done",
# none exited non-zero, and nothing reported a sanitizer error or a signal. Each rank's exit code
# is taken from the rank itself: after a fault a rank leaves without MPI_Finalize, mpirun then
# kills the ranks still running (no exit code, which passes once that rank printed "done") and
# its own exit code is non-zero, which is expected. Usage: fault_exit.sh BIN MPIEXEC MODE
set -u
bin="$1" mpiexec="$2" mode="$3"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 FAULT_DIR="$dir"
[ "$mode" = mismatch ] && export ACC_MPI_MAX_COUNT=1000
timeout 120 "$mpiexec" -np 2 --oversubscribe sh -c \
  '"$0" "$2" > "$1/out.$OMPI_COMM_WORLD_RANK" 2>&1; echo $? > "$1/rc.$OMPI_COMM_WORLD_RANK"' \
  "$bin" "$dir" "$mode" > "$dir/mpirun.log" 2>&1
ok=1
for r in 0 1; do
  rc=$(cat "$dir/rc.$r" 2>/dev/null || echo missing)
  echo "--- rank $r (exit code $rc)"
  cat "$dir/out.$r" 2>/dev/null
  [ "$rc" = 0 ] || [ "$rc" = missing ] || ok=0
  grep -q "rank $r: done" "$dir/out.$r" 2>/dev/null || ok=0
  if grep -qE "AddressSanitizer|runtime error|Signal:|Aborted|free\(\)" "$dir/out.$r" 2>/dev/null; then
    ok=0
  fi
done
if grep -qE "AddressSanitizer|Signal:" "$dir/mpirun.log"; then
  cat "$dir/mpirun.log"
  ok=0
fi
[ "$ok" = 1 ] && echo "fault_exit $mode: clean" && exit 0
echo "fault_exit $mode: FAILED" >&2
exit 1
