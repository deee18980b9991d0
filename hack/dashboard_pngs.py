#!/usr/bin/env python3
"""Regenerate docs/observability/dashboard-*.png: the chart's Grafana dashboard
(charts/jobrunner/files/dashboard.json), each row drawn with matplotlib from a real
Prometheus's answers to the panels' own queries during a real run.

The run is tests/test_dashboard.py's (workers and `jobrunner metrics` scraped by
Prometheus v0.316.0 from the e2e cache, on an embedded PostgreSQL); this script runs that
test with JOBRUNNER_DASHBOARD_PNG_DIR set, under the shared lock of heavy jobs:

    flock /tmp/jobrunner-heavy.lock .venv/bin/python hack/dashboard_pngs.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "observability"


def main() -> int:
    env = {**os.environ, "JOBRUNNER_DASHBOARD_PNG_DIR": str(OUT)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_dashboard.py::test_every_panel_returns_data_from_a_real_run"],
                          cwd=REPO, env=env)
    if done.returncode == 0:
        print("\n".join(str(p.relative_to(REPO)) for p in sorted(OUT.glob("dashboard-*.png"))))
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
