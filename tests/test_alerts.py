"""The chart's alerts (charts/jobrunner/files/alerts.yaml), checked by a real promtool
(github.com/prometheus/prometheus cmd/promtool, built from the Go module proxy and cached
by tests/e2e/harness/build.py): the rules load, each alert fires in its case of
tests/alerts/alerts_test.yaml (and stays quiet where a false alarm is plausible), each
has a runbook paragraph in docs/observability.md, and the chart's PrometheusRule carries
exactly these rules."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.e2e.harness import build
from tests.support import helm
from tests.support.helm import needs_helm

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "charts/jobrunner/files/alerts.yaml"
CASES = REPO / "tests/alerts/alerts_test.yaml"
RUNBOOK = REPO / "docs/observability.md"
PROMTOOL = build.PROMETHEUS.dir() / "bin" / "promtool"

needs_promtool = pytest.mark.skipif(
    not os.access(PROMTOOL, os.X_OK) and not build.go_available(),
    reason="promtool is not built and go is missing: run `make e2e-bins`")


def alerts() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
            if "alert" in r]


def promtool(*args: str) -> subprocess.CompletedProcess:
    build.ensure("prometheus")  # (`make test` builds it in the background: wait for it)
    return subprocess.run([str(PROMTOOL), *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO)


@needs_promtool
def test_promtool_checks_the_rules():
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in done.stdout, done.stdout


@needs_promtool
def test_promtool_runs_every_alerts_cases():
    done = promtool("test", "rules", str(CASES))
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_a_firing_case_and_a_runbook():
    firing: set[str] = set()
    for case in yaml.safe_load(CASES.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            if check.get("exp_alerts"):
                firing.add(check["alertname"])
    names = [a["alert"] for a in alerts()]
    assert len(names) >= 8 and len(set(names)) == len(names)
    assert sorted(set(names) - firing) == [], "alerts without a firing case"
    headings = set(re.findall(r"^### (Jobrunner\w+)$", RUNBOOK.read_text(), re.M))
    assert sorted(set(names) - headings) == [], "alerts without a runbook paragraph"
    for a in alerts():
        assert a["annotations"]["runbook"] == f"docs/observability.md#{a['alert'].lower()}"


@needs_helm
def test_the_chart_ships_exactly_these_rules():
    out = helm.template("--set", "metrics.prometheusRule.enabled=true").stdout
    (rule,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "PrometheusRule"]
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    off = helm.template().stdout
    assert "PrometheusRule" not in off
