"""`jobrunner-controller` starts kopf with the handlers its modules register on import: a
fresh interpreter that imports only the entry point must find all of them (an entry point
that lost its imports starts kopf with kopf's own login and no handler at all)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, kopf
import jobrunner.operator.main
r = kopf.get_default_registry()
ids = {h.id for reg in (r._activities, r._changing, r._watching, r._spawning)
       for h in reg.get_all_handlers()}
print(json.dumps(sorted(ids)))
"""

# One per role: login and settings, BatchRun (create/update, cancel on delete, status
# refresh), WorkerPool (changes, deletion, scaling), BatchRunSchedule (its daemon).
EXPECTED = {"login", "configure", "start_or_update", "cancel_pending", "refresh",
            "pool_changed", "pool_deleted", "pool_scale", "run_schedule"}


def test_the_controller_entry_point_registers_every_handler() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], check=True, capture_output=True,
                         text=True, timeout=120).stdout
    registered = set(json.loads(out))
    assert registered >= EXPECTED, f"missing handlers: {sorted(EXPECTED - registered)}"
