"""The chart as `helm template` renders it, with the helm the e2e harness builds from Go
modules (tests/e2e/harness/build.py): for tests that read the rendered manifests without
a cluster."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e.harness import build

REPO = Path(__file__).resolve().parents[2]
HELM = build.helm_dir() / "bin" / "helm"

needs_helm = pytest.mark.skipif(not os.access(HELM, os.X_OK) and not build.go_available(),
                                reason="helm is not built and go is missing: make e2e-bins")


def template(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`helm template t charts/jobrunner ARGS`; waits for `make test`'s background build
    of helm first."""
    build.ensure("helm")
    return subprocess.run([str(HELM), "template", "t", "charts/jobrunner", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120, check=check)
