#!/usr/bin/env bash
# The whole test suite (`make test`): the e2e tests (one real node per machine, so one
# pytest process) run beside the rest of the suite (pytest-xdist workers); most tests of
# both wait on processes, leases and the cluster more than they compute. The e2e run's
# output is printed when it ends; the exit code is non-zero if either part failed.
set -uo pipefail
PY=${PY:-.venv/bin/python}
WORKERS=${TEST_WORKERS:-2}
log=$(mktemp "${TMPDIR:-/tmp}/jobrunner-e2e-XXXXXX.log")
trap 'kill -TERM "$e2e" 2>/dev/null; rm -f "$log"' EXIT

"$PY" -m pytest tests/e2e "$@" >"$log" 2>&1 &
e2e=$!
"$PY" -m pytest -n "$WORKERS" --ignore=tests/e2e "$@"
rest=$?
echo "== the rest of the suite: exit $rest; waiting for the e2e tests (tests/e2e) =="
wait "$e2e"
e2e_rc=$?
cat "$log"
echo "== e2e tests: exit $e2e_rc; the rest: exit $rest =="
[ "$rest" -eq 0 ] && [ "$e2e_rc" -eq 0 ]
