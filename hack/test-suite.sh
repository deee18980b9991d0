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
# alone, on a cluster of their own. Both parts list their slowest tests (--durations): the
# suite's time is the longer part's.
#
# Each pytest session has a base temporary directory of its own under this run's folder:
# by default every session of the user shares /tmp/pytest-of-$USER and the newest keeps
# only three, so a fourth session started meanwhile (the e2e exclusive part, or anyone's
# pytest on the machine) deletes the folders of tests still running (seen as a manifest
# gone, or pg_ctl failing on its data directory).
set -uo pipefail
# The suite starts thousands of Python processes (workers, the CLI, servers). Where the
# environment says PYTHONDONTWRITEBYTECODE (this machine's does), each one compiled the
# package's 119 modules from source again: 0.1 s of CPU per start, 0.45 s in all.
unset PYTHONDONTWRITEBYTECODE
PY=${PY:-.venv/bin/python}
WORKERS=${TEST_WORKERS:-2}
E2E_WORKERS=${E2E_WORKERS:-2}
work=$(mktemp -d "${TMPDIR:-/tmp}/jobrunner-suite-XXXXXX")
log="$work/e2e.log"
e2e=""
builder=""
cleanup() {
  if [ -n "$e2e" ]; then kill -TERM "$e2e" 2>/dev/null; wait "$e2e" 2>/dev/null; fi
  if [ -n "$builder" ]; then kill -TERM "$builder" 2>/dev/null; wait "$builder" 2>/dev/null; fi
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
    -m "not exclusive" --durations=30 --basetemp "$work/tmp-e2e-shared" "$@"
  shared=$?
  kill -TERM "$cluster"; wait "$cluster"; trap - EXIT
  echo "== e2e: the exclusive tests, alone on a cluster of their own =="
  "$PY" -m pytest tests/e2e -m exclusive --basetemp "$work/tmp-e2e-alone" "$@"
  alone=$?
  # (a selection that leaves no exclusive test is fine when the shared part ran tests)
  if [ "$alone" -eq 5 ] && [ "$shared" -ne 5 ]; then alone=0; fi
  echo "== e2e: shared cluster exit $shared; exclusive exit $alone =="
  [ "$shared" -eq 0 ] && [ "$alone" -eq 0 ]
}

# The rest of the suite runs in a CPU cgroup of low weight where this shell can make one
# (root, cgroup v1 cpu hierarchy; elsewhere it runs as is). The e2e tests wait on pods,
# the API server and the kubelet, and every delay of theirs is on the suite's critical
# path; the rest mostly computes (soaks) and can take whatever CPU the cluster leaves.
# Sharing the two cores evenly made the e2e half the longer one (14:50 beside 7:29 alone
# for the rest). A cgroup rather than nice: the test databases' servers start sessions of
# their own, and the kernel's autogroups would give each the full weight again.
REST_CPU_SHARES=${REST_CPU_SHARES:-512}
rest_cgroup=/sys/fs/cgroup/cpu/jobrunner-suite-rest-$$
low_cpu() {
  if [ -f /sys/fs/cgroup/cpu/cpu.shares ] && mkdir "$rest_cgroup" 2>/dev/null; then
    echo "$REST_CPU_SHARES" >"$rest_cgroup/cpu.shares"
    (echo "$BASHPID" >"$rest_cgroup/cgroup.procs" && exec "$@")
    local rc=$?
    rmdir "$rest_cgroup" 2>/dev/null  # (kept while a stray process is left in it)
    return $rc
  fi
  "$@"
}

# The Go binaries (tests/e2e/harness/build.py) are built in the background while the
# suite runs, not before it: on a cold machine they take most of a half hour of both
# cores, and the rest of the suite needs none of them but for three test files, which run
# last (tests/conftest.py: RUN_LAST). The cluster's binaries come first: the e2e part
# waits for them. Whoever needs a part waits for its lock, then finds it built. The build
# needs only the standard library: it starts before the virtualenv and the Debian
# packages are made (a cold run's first minutes wait on the network), and in a cold run
# the builds are what the suite's end waits for.
"${PYTHON:-python3}" -m tests.e2e.harness.build >"$work/build.log" 2>&1 &
builder=$!
if [ -n "${SETUP:-}" ]; then
  # (word splitting intended: the Makefile's setup command)
  $SETUP || exit 1
fi

e2e_tests "$@" >"$log" 2>&1 &
e2e=$!
low_cpu "$PY" -m pytest -n "$WORKERS" --ignore=tests/e2e --durations=20 \
  --basetemp "$work/tmp-rest" "$@"
rest=$?
echo "== the rest of the suite: exit $rest; waiting for the e2e tests (tests/e2e) =="
wait "$e2e"
e2e_rc=$?
e2e=""
wait "$builder"
build_rc=$?
builder=""
echo "== the Go binaries (exit $build_rc): what was built, and when it was ready =="
grep -E "built in|ready in|failed|error" "$work/build.log" || true
if [ "$build_rc" -ne 0 ]; then tail -40 "$work/build.log"; fi
cat "$log"
echo "== e2e tests: exit $e2e_rc; the rest: exit $rest; Go binaries: exit $build_rc =="
[ "$rest" -eq 0 ] && [ "$e2e_rc" -eq 0 ] && [ "$build_rc" -eq 0 ]
