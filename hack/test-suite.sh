#!/usr/bin/env bash
# The whole test suite (`make test`): the e2e tests run beside the rest of the suite
# (pytest-xdist workers); most tests of both wait on processes, leases and the cluster
# more than they compute. The e2e run's output is printed when it ends; the exit code is
# non-zero if either part failed.
#
# The e2e tests share one real cluster (one node per machine): it is started once
# (python -m tests.e2e.harness.cluster --info FILE) and E2E_WORKERS pytest workers attach
# to it (JOBRUNNER_E2E_CLUSTER=FILE, whole test files per worker). The few tests marked
# `exclusive` (they restart the API server or run a cluster-wide controller) then run
# alone, on a cluster of their own.
set -uo pipefail
PY=${PY:-.venv/bin/python}
WORKERS=${TEST_WORKERS:-2}
E2E_WORKERS=${E2E_WORKERS:-2}
work=$(mktemp -d "${TMPDIR:-/tmp}/jobrunner-suite-XXXXXX")
log="$work/e2e.log"
e2e=""
cleanup() {
  if [ -n "$e2e" ]; then kill -TERM "$e2e" 2>/dev/null; wait "$e2e" 2>/dev/null; fi
  rm -rf "$work"
}
trap cleanup EXIT

e2e_tests() {
  local info="$work/cluster.json" shared=0 alone=0
  "$PY" -m tests.e2e.harness.cluster --no-postgres --info "$info" \
    --kubeconfig "$work/kubeconfig" >"$work/cluster.log" 2>&1 &
  cluster=$!
  # (this runs in a background subshell: its own traps stop the cluster it started)
  trap 'kill -TERM "$cluster" 2>/dev/null; wait "$cluster" 2>/dev/null' EXIT
  trap 'exit 143' TERM INT
  until [ -s "$info" ]; do
    if ! kill -0 "$cluster" 2>/dev/null; then
      echo "the e2e cluster did not start:"; tail -50 "$work/cluster.log"; return 1
    fi
    sleep 0.5
  done
  echo "== e2e: $E2E_WORKERS workers on one cluster (tests not marked exclusive) =="
  JOBRUNNER_E2E_CLUSTER="$info" "$PY" -m pytest tests/e2e -n "$E2E_WORKERS" --dist loadfile \
    -m "not exclusive" "$@"
  shared=$?
  kill -TERM "$cluster"; wait "$cluster"; trap - EXIT
  echo "== e2e: the exclusive tests, alone on a cluster of their own =="
  "$PY" -m pytest tests/e2e -m exclusive "$@"
  alone=$?
  # (a selection that leaves no exclusive test is fine when the shared part ran tests)
  if [ "$alone" -eq 5 ] && [ "$shared" -ne 5 ]; then alone=0; fi
  echo "== e2e: shared cluster exit $shared; exclusive exit $alone =="
  [ "$shared" -eq 0 ] && [ "$alone" -eq 0 ]
}

e2e_tests "$@" >"$log" 2>&1 &
e2e=$!
"$PY" -m pytest -n "$WORKERS" --ignore=tests/e2e "$@"
rest=$?
echo "== the rest of the suite: exit $rest; waiting for the e2e tests (tests/e2e) =="
wait "$e2e"
e2e_rc=$?
e2e=""
cat "$log"
echo "== e2e tests: exit $e2e_rc; the rest: exit $rest =="
[ "$rest" -eq 0 ] && [ "$e2e_rc" -eq 0 ]
