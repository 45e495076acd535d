#!/usr/bin/env bash
# `make test`: every test, in two pytest processes side by side. The Spin model checks
# (marker `models`: pan is one busy core for minutes) run beside the rest, which is mostly
# waiting on child processes, sockets and timeouts; one after the other they took 13 min
# of wall time on two cores for 9.5 min of CPU. The models' output is printed after the
# rest's; the exit status is the first failure's.
set -u
PY="${1:?usage: tools/test-all.sh PYTHON}"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
"$PY" -m pytest -m models -p no:cacheprovider --durations=10 >"$log" 2>&1 &
models=$!
"$PY" -m pytest -m "not models" --durations=25
rest=$?
wait "$models"
checks=$?
echo "================ the model checks (pytest -m models), run beside the rest ================"
cat "$log"
[ "$rest" -ne 0 ] && exit "$rest"
exit "$checks"
