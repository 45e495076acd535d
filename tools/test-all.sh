#!/usr/bin/env bash
# `make test`: every test, in two pytest runs side by side, each test once.
#
# Beside the rest: the Spin model checks (marker `models`: pan is one busy core for
# minutes), then the longest slow tests (BESIDE: the soak and churn, crosshair, the
# stateful lifecycle, the generator's and NIXL's). The rest is mostly waiting on child
# processes, sockets and timeouts. Measured on two cores (2026-12-07): the models beside
# everything else took 13 min of wall time, the rest being the long pole; the models with
# every slow test, 12 min, the other way round. Each file in BESIDE must exist: pytest
# refuses a missing path. The first run's output is printed after the rest's; the exit
# status is the first failure's.
set -u
PY="${1:?usage: tools/test-all.sh PYTHON}"
BESIDE=(tests/soak tests/test_contracts.py tests/lifecycle/test_stateful_lifecycle.py tests/test_generate.py
        tests/test_nixl_transport.py)
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
(
  "$PY" -m pytest -m models -p no:cacheprovider --durations=10
  models=$?
  "$PY" -m pytest -m "not models" -p no:cacheprovider --durations=10 "${BESIDE[@]}"
  beside=$?
  [ "$models" -ne 0 ] && exit "$models"
  exit "$beside"
) >"$log" 2>&1 &
heavy=$!
# A background job ignores SIGINT: on Ctrl-C (or a TERM), end its pytest too.
trap 'pkill -TERM -P "$heavy" 2>/dev/null; kill "$heavy" 2>/dev/null; exit 130' INT TERM
"$PY" -m pytest -m "not models" "${BESIDE[@]/#/--ignore=}" --durations=25
rest=$?
wait "$heavy"
checks=$?
echo "================ beside the rest: the model checks, then ${BESIDE[*]} ================"
cat "$log"
[ "$rest" -ne 0 ] && exit "$rest"
exit "$checks"
