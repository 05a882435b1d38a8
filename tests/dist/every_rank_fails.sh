#!/usr/bin/env bash
# Runs fail_on_rank_one under mpirun -np 2 and checks that *every* rank exited non-zero, although
# only rank 1 failed a test, and that no rank's failure was a sanitizer report (the exit code alone
# cannot tell: AddressSanitizer exits 1 too).
set -u
bin="$1"
mpiexec="$2"
dir=$(mktemp -d)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
"$mpiexec" -np 2 --oversubscribe sh -c \
  '"$0" > "$1/out.$OMPI_COMM_WORLD_RANK" 2>&1; echo $? > "$1/rc.$OMPI_COMM_WORLD_RANK"' "$bin" "$dir"
ok=1
for r in 0 1; do
  rc=$(cat "$dir/rc.$r" 2>/dev/null || echo missing)
  echo "rank $r exit code: $rc"
  if [ "$rc" = "0" ] || [ "$rc" = "missing" ]; then ok=0; fi
  if grep -qE "AddressSanitizer|runtime error" "$dir/out.$r" 2>/dev/null; then
    cat "$dir/out.$r"
    ok=0
  fi
done
rm -rf "$dir"
[ "$ok" = 1 ] && echo "every rank failed, as it must" && exit 0
echo "a rank exited 0 although rank 1 failed, or a sanitizer reported an error" >&2
exit 1
