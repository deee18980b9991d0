#!/usr/bin/env python3
"""Mutation check: does the suite catch a broken guarantee?

Each mutant below breaks ONE guarantee of README.md in the source (SQL or Python), the
way a plausible regression would. The check copies the tree (the files git knows, as
they are in the work tree), applies one mutant to the copy, and runs the few tests that
cover that guarantee against the copy. A mutant is *killed* when one of them fails; the
report names that test. A mutant that survives is a guarantee no test would defend: the
fix is a test, not a weaker mutant.

A mutant finds its target by a text snippet and says how many times the snippet must
occur. When a refactor moves or rewords the code, the snippet is not found and the check
fails loudly ("snippet not found"): a mutant can never silently become a no-op. Move the
snippet with the code.

    hack/mutants.py --check            every snippet found as often as it says (no tests run)
    hack/mutants.py                    run every mutant; a table of mutants and their killers
                                       (CI runs every mutant too, one test each:
                                       tests/test_mutants.py)
    hack/mutants.py NAME ...           run these mutants only
    hack/mutants.py --baseline ...     first run the selected mutants' tests on the unmutated
                                       copy: they must pass, else a "kill" proves nothing
    hack/mutants.py --report FILE      also write the table (markdown) to FILE

The tests run in the copy with this interpreter (`python -m pytest` there imports the
copy's jobrunner first, and tests/support/processes.py points worker processes at it too). Exit
status: 0 when every mutant run was killed (and the baseline passed), 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Edit:
    path: str
    old: str
    new: str
    count: int = 1  # how many times `old` must occur (all are replaced)


@dataclass(frozen=True)
class Mutant:
    name: str
    guarantee: str  # what breaks, in README's words
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]  # pytest arguments: files, node ids, -k expressions
    timeout: int = 300  # seconds per test (pytest-timeout): a hang is a kill too
    notes: str = field(default="", compare=False)


TASKS = "sql/queries/tasks.sql"
EFFECTS = "sql/queries/effects.sql"
REDUCE = "sql/queries/reduce.sql"
FLOW = "sql/queries/flowcontrol.sql"
M13 = "sql/migrations/0013_limit_functions.sql"
M16 = "sql/migrations/0016_shard_lease_in_task_row.sql"
M17 = "sql/migrations/0017_task_key_table.sql"
M18 = "sql/migrations/0018_one_leased_index.sql"
M20 = "sql/migrations/0020_pool_flow_control.sql"  # (redefines jobrunner_limit_admit)
CLIENT = "jobrunner/queue/client.py"

# The claim's lease deadline, as the three claim statements (batch, limited, pool) write it.
LEASE_DEADLINE = ("        locked_until = now() + make_interval(secs => %(visibility_timeout)s),\n"
                  "        attempts = q.attempts + 1,\n")
CLAIM_LOCK = "    LIMIT %(limit)s\n    FOR UPDATE OF q SKIP LOCKED\n"
SHARD_PREFILTER = """      AND NOT EXISTS (  -- (a leased task of the shard: see "Shard leases")
          SELECT 1 FROM agent_work_queue l
          WHERE l.tenant_id = q.tenant_id AND l.shard_key = q.shard_key
            AND l.status = 'leased'
          OFFSET 0)  -- one index probe per candidate, never a join: see "Shard pre-filter"
"""
SHARD_CHECK = """    RETURN NOT EXISTS (SELECT 1 FROM agent_work_queue l
                       WHERE l.tenant_id = p_tenant AND l.shard_key = p_shard
                         AND l.status = 'leased');"""
LEASED_UNIQUE = """CREATE UNIQUE INDEX agent_work_queue_leased_uidx
    ON agent_work_queue (tenant_id, shard_key)
    WHERE status = 'leased';"""
LEASED_NOT_UNIQUE = """CREATE INDEX agent_work_queue_leased_uidx
    ON agent_work_queue (tenant_id, shard_key)
    WHERE status = 'leased';"""

MUTANTS: tuple[Mutant, ...] = (
    # -- claim -----------------------------------------------------------------------
    Mutant("claim-without-skip-locked",
           "a claim skips rows other claims hold locked, never waits on them",
           (Edit(TASKS, CLAIM_LOCK, "    LIMIT %(limit)s\n    FOR UPDATE OF q\n", 4),),
           ("tests/test_queue.py", "-k", "skips_rows_another_transaction")),
    Mutant("claim-ignores-run-after",
           "a task waiting out its retry backoff is not claimed before run_after",
           (Edit(TASKS, "      AND q.status = 'pending'\n      AND q.run_after <= now()\n",
                 "      AND q.status = 'pending'\n", 4),),
           ("tests/test_queue.py", "-k", "backs_off")),
    Mutant("worker-clock-for-locked-until",
           "time comes from the database (now()), never from a worker's clock",
           (Edit(TASKS, LEASE_DEADLINE,
                 LEASE_DEADLINE.replace("now()", "%(worker_now)s::timestamptz"), 4),
            Edit(CLIENT, '"after_id": after[1] if after else 0,',
                 '"after_id": after[1] if after else 0, "worker_now": __import__("datetime")'
                 '.datetime.now(__import__("datetime").timezone.utc),', 2)),
           ("tests/test_time_from_database.py",)),
    # -- shard exclusion -------------------------------------------------------------
    Mutant("shard-exclusion-off",
           "tasks of one (tenant, shard) never hold live leases at the same time",
           (Edit(TASKS, SHARD_PREFILTER, "", 4),
            Edit(M16, SHARD_CHECK, "    RETURN true;"),
            Edit(M18, LEASED_UNIQUE, LEASED_NOT_UNIQUE)),
           ("tests/test_queue.py", "-k", "shard_exclusion_sequential")),
    Mutant("shard-take-without-check",
           "shard exclusion under concurrent claims (the try-locked check, not the index)",
           (Edit(M16, SHARD_CHECK, "    RETURN true;"),
            Edit(M18, LEASED_UNIQUE, LEASED_NOT_UNIQUE)),
           ("tests/test_concurrency.py", "-k", "never_share_a_shard")),
    Mutant("shard-take-without-try-lock",
           "a claim never fails on a shard another claim takes at the same instant",
           (Edit(M16, "    IF NOT pg_try_advisory_xact_lock(1246970229, "
                      "hashtext(p_tenant || '/' || p_shard)) THEN",
                 "    IF false THEN"),),
           ("tests/test_concurrency.py", "-k", "never_share_a_shard")),
    # -- fencing ---------------------------------------------------------------------
    Mutant("ack-fenced-without-attempt",
           "fencing: ack is conditional on (id, lease_owner, attempt)",
           (Edit(TASKS, "      AND q.attempts = (%(attempts)s::int[])"
                        "[array_position(%(ids)s::bigint[], q.id)]\n", ""),),
           ("tests/test_queue.py", "-k", "stale or same_worker")),
    Mutant("ack-fenced-without-owner",
           "fencing: a worker that lost its lease can never overwrite a newer attempt",
           (Edit(TASKS, "      AND q.attempts = (%(attempts)s::int[])"
                        "[array_position(%(ids)s::bigint[], q.id)]\n"
                        "      AND q.lease_owner = %(worker_id)s\n",
                 "      AND q.attempts = (%(attempts)s::int[])"
                 "[array_position(%(ids)s::bigint[], q.id)]\n"),),
           ("tests/test_queue.py", "-k", "fenced or stale")),
    Mutant("heartbeat-fenced-without-attempt",
           "fencing: heartbeat is conditional on (id, lease_owner, attempt)",
           (Edit(TASKS, "  AND q.id = t.id\n  AND q.attempts = t.attempt\n"
                        "  AND q.lease_owner = %(worker_id)s\n  AND q.status || '' = 'leased'"
                        "  -- by primary key, never the leased index: see Plans\n"
                        "RETURNING q.id;",
                 "  AND q.id = t.id\n"
                 "  AND q.lease_owner = %(worker_id)s\n  AND q.status || '' = 'leased'"
                 "  -- by primary key, never the leased index: see Plans\n"
                 "RETURNING q.id;"),),
           ("tests/test_queue.py", "-k", "same_worker")),
    Mutant("fail-fenced-without-attempt",
           "fencing: fail is conditional on (id, lease_owner, attempt)",
           (Edit(TASKS, "    WHERE q.id = %(id)s\n      AND q.attempts = %(attempt)s\n",
                 "    WHERE q.id = %(id)s\n", 2),),
           ("tests/test_queue.py", "-k", "same_worker")),
    Mutant("release-fenced-without-owner",
           "fencing: release never gives back a task someone else holds",
           (Edit(TASKS, "      AND q.attempts = t.attempt\n"
                        "      AND q.lease_owner = %(worker_id)s\n"
                        "      AND q.status || '' = 'leased'  -- by primary key, never the "
                        "leased index: see Plans\n    RETURNING q.id, q.tenant_id, q.shard_key,"
                        " q.limits, q.batch_id,",
                 "      AND q.attempts = t.attempt\n"
                 "      AND q.status || '' = 'leased'  -- by primary key, never the "
                 "leased index: see Plans\n    RETURNING q.id, q.tenant_id, q.shard_key,"
                 " q.limits, q.batch_id,"),),
           ("tests/test_queue.py", "-k", "release_does_not_burn")),
    Mutant("once-outside-the-lease-check",
           "task.once re-checks the lease: a worker that lost it cannot apply the effect",
           (Edit("jobrunner/runtime/effects.py",
                 "if not effects.fence(conn, lease.id, lease.attempt, worker_id):",
                 "if effects.fence(conn, lease.id, lease.attempt, worker_id) is None:"),),
           ("tests/test_queue.py", "-k", "once_refuses_an_effect")),
    Mutant("once-without-ledger",
           "task.once: an effect that committed is never applied again by a retry",
           (Edit(EFFECTS, "ON CONFLICT DO NOTHING\nRETURNING 1;",
                 "ON CONFLICT (batch_id, task_key, effect_key) DO UPDATE SET attempt ="
                 " EXCLUDED.attempt\nRETURNING 1;"),),
           ("tests/test_worker.py", "-k", "effect_is_applied_once_across_a_crash")),
    Mutant("lost-lease-outcome-acked",
           "a worker stops a task whose lease is lost and never acks it",
           (Edit("jobrunner/worker/completer.py",
                 "if entry is not None and entry.task.lease_lost.is_set():",
                 "if False:"),),
           ("tests/test_worker.py", "-k",
            "lease_lost_to_failed_heartbeats or lease_lost_kills_command_handler"),
           notes="a lease lost to a re-claim is fenced in SQL anyway: the killer is a lease "
                 "given up for want of heartbeats while its row still names the worker"),
    # -- leases: heartbeat, expiry, rescue -------------------------------------------
    Mutant("heartbeat-off",
           "a long handler keeps its lease by heartbeats (and runs once)",
           (Edit("jobrunner/worker/heartbeat.py", "                    self._beat(q)\n",
                 "                    pass\n"),),
           ("tests/test_worker.py", "-k", "kept_alive_by_heartbeats")),
    Mutant("expiry-never-dead",
           "an expired lease whose attempts are used up ends dead",
           (Edit(TASKS, "                      WHEN q.attempts >= q.max_attempts THEN 'dead' "
                        "ELSE 'pending' END,\n        run_after = now(),",
                 "                      ELSE 'pending' END,\n        run_after = now(),"),),
           ("tests/test_queue.py", "-k", "expire_returns_to_pending_or_dead")),
    Mutant("rescue-late",
           "an expired lease is rescued within about a second of locked_until",
           (Edit(TASKS, "    WHERE status = 'leased' AND locked_until < now()\n",
                 "    WHERE status = 'leased' AND locked_until < now() - interval '8 s'\n"),),
           ("tests/test_rescue_latency.py",)),
    # -- retries ---------------------------------------------------------------------
    Mutant("backoff-without-jitter",
           "retries back off with up to 25 % jitter",
           (Edit(TASKS, "* (1 + 0.25 * random())", "* (1 + 0.25 * 0)"),),
           ("tests/test_queue.py", "-k", "backs_off or jitter")),
    Mutant("backoff-not-exponential",
           "retries back off min(cap, base * 2^attempt) seconds",
           (Edit(TASKS, "%(backoff_base)s::float8 * power(2, q.attempts)",
                 "%(backoff_base)s::float8 * power(2, 1)"),),
           ("tests/test_queue.py", "-k", "backs_off")),
    Mutant("backoff-uncapped",
           "retries back off at most the cap",
           (Edit(TASKS, "now() + make_interval(secs => least(\n"
                        "                             %(backoff_cap)s::float8,",
                 "now() + make_interval(secs => greatest(\n"
                 "                             %(backoff_cap)s::float8,"),),
           ("tests/test_queue.py", "-k", "capped")),
    Mutant("permanent-error-retried",
           "PermanentError: the task ends dead at once",
           (Edit(TASKS, "    SET status = CASE WHEN %(permanent)s OR q.attempts >= q.max_attempts"
                        " THEN 'dead'",
                 "    SET status = CASE WHEN q.attempts >= q.max_attempts THEN 'dead'"),),
           ("tests/test_queue.py", "-k", "permanent_goes_dead")),
    Mutant("release-burns-an-attempt",
           "SIGTERM gives running tasks back without using an attempt",
           (Edit(TASKS, "        attempts = q.attempts - 1,\n        run_after = now(),\n",
                 "        run_after = now(),\n"),),
           ("tests/test_queue.py", "-k", "release_does_not_burn")),
    # -- enqueue ---------------------------------------------------------------------
    Mutant("enqueue-not-idempotent",
           "(batch, task key) is unique: re-submitting creates no duplicates",
           (Edit(M17, "    IF NOT FOUND THEN\n        RETURN NULL;",
                 "    IF false THEN\n        RETURN NULL;"),),
           ("tests/test_queue.py", "-k", "enqueue_is_idempotent")),
    # -- reduce ----------------------------------------------------------------------
    Mutant("reduce-enqueued-on-a-count",
           "a reduce step is enqueued once every other task is terminal, read from the "
           "rows, never counted",
           (Edit(REDUCE, "      AND b.reduce IS NOT NULL AND b.cancelled_at IS NULL"
                         " AND b.reduce_enqueued_at IS NULL\n"
                         "      AND jobrunner_batch_settled(b.batch_id, b.reduce->>'onDead')\n",
                 "      AND b.reduce IS NOT NULL AND b.cancelled_at IS NULL"
                 " AND b.reduce_enqueued_at IS NULL\n"
                 "      AND (SELECT count(*) FROM agent_work_queue w WHERE w.batch_id ="
                 " b.batch_id AND w.status IN ('done', 'dead')) >= b.tasks\n"),),
           ("tests/test_generators.py", "-k",
            "holds_the_reduce_back or fails_for_good or reduce_runs_once"),
           notes="the trigger's lock-free look (reduce_state, not mutated) decides `due` "
                 "first, so the count only judges what commits between that look and the "
                 "batch lock: an enqueue into a batch whose generator's own done row makes "
                 "the count one more than b.tasks"),
    Mutant("cancelled-batch-reduces",
           "a cancelled batch never reduces",
           (Edit(REDUCE, "      AND b.reduce IS NOT NULL AND b.cancelled_at IS NULL"
                         " AND b.reduce_enqueued_at IS NULL\n",
                 "      AND b.reduce IS NOT NULL AND b.reduce_enqueued_at IS NULL\n"),),
           ("tests/test_reduce.py", "-k",
            "cancel_committed_as_the_trigger_fires or cancelled_mid_run_never_reduces"),
           notes="the trigger's lock-free look (reduce_state, not mutated) never calls a "
                 "cancelled batch due, so only a cancel committed between that look and the "
                 "batch lock reaches the mutated statement"),
    # -- flow control ----------------------------------------------------------------
    Mutant("request-limit-never-charged",
           "at most `requests` tasks naming a limit are claimed in any window of `per` s",
           (Edit(M13, "    SET request_tat = CASE WHEN l.requests IS NULL THEN l.request_tat\n"
                      "                           ELSE greatest(l.request_tat, p_clock)",
                 "    SET request_tat = CASE WHEN true THEN l.request_tat\n"
                 "                           ELSE greatest(l.request_tat, p_clock)"),),
           ("tests/test_limits.py", "-k", "request_limit_is_shared")),
    Mutant("limit-lanes-not-locked",
           "limits are checked and charged in the claim statement itself, under the "
           "lane's lock (concurrent claims cannot both spend one slot)",
           tuple(Edit(m, "            LIMIT 1\n            FOR NO KEY UPDATE OF x SKIP LOCKED) ln",
                      "            LIMIT 1) ln") for m in (M13, M20)),
           ("tests/test_limits.py", "-k", "request_limit_is_shared or max_concurrent_holds")),
    Mutant("limit-charged-after-the-claim",
           "limits are charged in the claim statement: a claim admitted is a claim counted "
           "(here the charge is left to a later statement that never comes)",
           (Edit(TASKS, "        updated_at = CASE WHEN q.limits IS NULL THEN now()\n"
                        "                          ELSE (SELECT t FROM charged) END\n",
                 "        updated_at = now()\n", 2),),
           ("tests/test_limits.py", "-k", "request_limit_is_shared")),
    Mutant("max-concurrent-ignored",
           "never more than max_concurrent tasks of a limit hold a lease",
           tuple(Edit(m, "AND (k.max_concurrent IS NULL OR v.live + w.rank <= k.max_concurrent)",
                      "AND (k.max_concurrent IS NULL OR true)") for m in (M13, M20)),
           ("tests/test_limits.py", "-k", "max_concurrent_holds")),
    Mutant("token-usage-never-settled",
           "reported usage settles token estimates (at the report, not at the ack)",
           (Edit("jobrunner/store/flowcontrol.py",
                 "correction = usage.tokens - estimate if first else usage.tokens",
                 "correction = 0"),),
           ("tests/test_limits.py", "-k", "settles_the_token_limit_at_once")),
    # -- pools -----------------------------------------------------------------------
    Mutant("priority-starves-the-rest",
           "a batch's --priority multiplies its weight without starving the rest",
           (Edit("sql/migrations/0014_pools.sql", "* power(10.0, p_priority))::float8",
                 "* power(10.0, 10 * p_priority))::float8"),),
           ("tests/test_pools.py", "-k", "priority_does_not_starve")),
    Mutant("priority-ignored",
           "a batch's --priority multiplies its weight",
           (Edit("sql/migrations/0014_pools.sql", "* power(10.0, p_priority))::float8",
                 "* power(10.0, 0))::float8"),),
           ("tests/test_pools.py", "-k", "priority_does_not_starve")),
    Mutant("budget-never-checked",
           "a batch's budget stops its claims",
           (Edit(TASKS, "      AND NOT EXISTS (\n          SELECT 1 FROM agent_batch_usage b\n"
                        "          WHERE b.batch_id = %(batch_id)s\n"
                        "            AND (b.tokens >= b.budget_tokens"
                        " OR b.cost >= b.budget_cost))\n",
                 ""),),
           ("tests/test_limits.py", "-k", "budget_stops_claims")),
    Mutant("tenant-budget-never-checked",
           "a tenant's budget in a pool stops every batch of the tenant there",
           (Edit(TASKS, "            AND (t.tokens >= t.budget_tokens"
                        " OR t.cost >= t.budget_cost)\n",
                 "            AND false\n"),),
           ("tests/test_pool_limits.py", "-k", "tenants_budget_in_a_pool")),
    Mutant("rate-limited-pauses-nobody",
           "a rate-limited answer (429) pauses the limit for everyone",
           (Edit(FLOW, "    blocked_until = greatest(coalesce(l.blocked_until, now()),\n"
                       "                             now() + make_interval(secs => "
                       "%(retry_after)s::float8)),",
                 "    blocked_until = l.blocked_until,"),),
           ("tests/test_limits.py", "-k", "429_pauses")),
    Mutant("rate-limited-burns-an-attempt",
           "a rate-limited answer does not use an attempt",
           (Edit(TASKS, "                        THEN q.attempts ELSE q.attempts - 1 END,",
                 "                        THEN q.attempts ELSE q.attempts END,"),),
           ("tests/test_limits.py", "-k", "429_pauses")),
    # -- metrics ---------------------------------------------------------------------
    Mutant("metrics-queue-wait-until-lease-deadline",
           "the queue-wait metric measures from due to claim, by the database's clock",
           (Edit("jobrunner/worker/executor.py",
                 "claimed_at = lease.locked_until.timestamp() - self.visibility_timeout",
                 "claimed_at = lease.locked_until.timestamp()"),),
           ("tests/test_metrics.py", "-k", "observes_each_attempt")),
)


class SnippetError(Exception):
    pass


def tracked_files(repo: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=repo, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p and (repo / p).is_file()]


def copy_tree(repo: Path, dest: Path) -> None:
    for rel in tracked_files(repo):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, target)


def apply(mutant: Mutant, root: Path) -> None:
    """Apply every edit of the mutant under root; SnippetError when a snippet is not
    found exactly `count` times (nothing is written then)."""
    pending: dict[Path, str] = {}
    for edit in mutant.edits:
        path = root / edit.path
        if not path.exists():
            raise SnippetError(f"{mutant.name}: {edit.path} does not exist")
        text = pending.get(path, path.read_text())
        found = text.count(edit.old)
        if found != edit.count:
            raise SnippetError(f"{mutant.name}: snippet not found {edit.count} time(s) in "
                               f"{edit.path} (found {found}):\n{edit.old}")
        pending[path] = text.replace(edit.old, edit.new)
    for path, text in pending.items():
        path.write_text(text)


def check_all(root: Path = REPO) -> list[str]:
    """Every mutant's snippets, against the tree at root (read only): the problems."""
    problems = []
    names = [m.name for m in MUTANTS]
    if len(set(names)) != len(names):
        problems.append("two mutants share a name")
    for mutant in MUTANTS:
        texts: dict[str, str] = {}
        for edit in mutant.edits:
            path = root / edit.path
            if not path.exists():
                problems.append(f"{mutant.name}: {edit.path} does not exist")
                continue
            text = texts.setdefault(edit.path, path.read_text())
            found = text.count(edit.old)
            if found != edit.count:
                problems.append(f"{mutant.name}: snippet in {edit.path} found {found} "
                                f"time(s), expected {edit.count}: {edit.old[:80]!r}")
            else:
                texts[edit.path] = text.replace(edit.old, edit.new)
        for arg in mutant.tests:
            if arg.startswith("tests/") and not (root / arg.split("::")[0]).exists():
                problems.append(f"{mutant.name}: test file {arg} does not exist")
    return problems


@dataclass
class Outcome:
    mutant: Mutant
    killed: bool
    killer: str  # the first failing test's node id, or why it counts as survived
    seconds: float
    output: str = ""


_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)


def run_tests(root: Path, args: tuple[str, ...], timeout: int) -> tuple[int, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root)
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_CURRENT_TEST", None)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider",
           "-p", "no:randomly", "-n", "0", f"--timeout={timeout}", *args]
    try:
        r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                           timeout=timeout * 3 + 120)
        return r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
        return -1, out + "\n(timed out as a whole)"


def run_mutant(mutant: Mutant, base: Path) -> Outcome:
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f"mutant-{mutant.name}-"))
    try:
        root = work / "tree"
        shutil.copytree(base, root, symlinks=True)
        apply(mutant, root)
        code, out = run_tests(root, mutant.tests, mutant.timeout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    seconds = time.monotonic() - started
    if code == 1:
        failed = _FAILED.findall(out)
        return Outcome(mutant, True, failed[0] if failed else "(a test failed)", seconds, out)
    if code == 0:
        return Outcome(mutant, False, "SURVIVED: every selected test passed", seconds, out)
    if code == 5:
        return Outcome(mutant, False, "SURVIVED: no test selected", seconds, out)
    if code == -1:
        return Outcome(mutant, True, "(the tests hung past every timeout)", seconds, out)
    # 2/3/4: interrupted, internal error, usage error: not a kill by a test
    return Outcome(mutant, False, f"NOT RUN: pytest exited {code}", seconds, out)


def table(outcomes: list[Outcome]) -> str:
    lines = ["| mutant | guarantee broken | killed by | s |", "|---|---|---|---|"]
    for o in outcomes:
        mark = o.killer if o.killed else f"**{o.killer}**"
        lines.append(f"| {o.mutant.name} | {o.mutant.guarantee} | {mark} | {o.seconds:.0f} |")
    killed = sum(o.killed for o in outcomes)
    lines.append(f"\n{killed} of {len(outcomes)} mutants killed.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--check", action="store_true", help="check the snippets only")
    parser.add_argument("--baseline", action="store_true",
                        help="first run the selected tests on the unmutated copy")
    parser.add_argument("--list", action="store_true", help="list the mutants")
    parser.add_argument("--report", type=Path, help="write the table to this file too")
    args = parser.parse_args(argv)

    problems = check_all()
    if problems:
        print("mutants: snippets that no longer match the source (move them with the code):",
              *problems, sep="\n  ", file=sys.stderr)
        return 1
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:36} {m.guarantee}")
        return 0
    if args.check:
        print(f"mutants: {len(MUTANTS)} mutants, every snippet found")
        return 0
    by_name = {m.name: m for m in MUTANTS}
    names = args.names or list(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        print(f"unknown mutants: {unknown}", file=sys.stderr)
        return 2
    selected = [by_name[n] for n in names]

    base_dir = Path(tempfile.mkdtemp(prefix="mutants-base-"))
    base = base_dir / "tree"
    try:
        copy_tree(REPO, base)
        ok = True
        if args.baseline:
            # The union of the selections, unmutated: a mutant's kill counts only if its
            # tests pass without it.
            for m in selected:
                code, out = run_tests(base, m.tests, m.timeout)
                print(f"baseline {m.name}: pytest exit {code}", flush=True)
                if code != 0:
                    print(out[-4000:])
                    ok = False
        outcomes = []
        for m in selected:
            o = run_mutant(m, base)
            outcomes.append(o)
            verdict = "killed by " + o.killer if o.killed else o.killer
            print(f"mutant {m.name}: {verdict} ({o.seconds:.0f}s)", flush=True)
            if not o.killed:
                print(o.output[-3000:])
    finally:
        shutil.rmtree(base_dir, ignore_errors=True)
    report = table(outcomes)
    print("\n== mutation report ==\n" + report)
    if args.report:
        args.report.write_text(report + "\n")
    return 0 if ok and all(o.killed for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
