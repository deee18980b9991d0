"""The controller's rule for tenants bound to namespaces (jobrunner/operator/tenancy.py),
the same as the chart's admission policy (tests/e2e/test_tenancy_e2e.py runs both)."""

from __future__ import annotations

import pytest

from jobrunner.operator.config import _tenants
from jobrunner.operator.tenancy import ANNOTATION, refusal


@pytest.mark.parametrize("tenant,annotations,extra", [
    ("team-a", {}, {}),
    ("x", {ANNOTATION: "y, x"}, {}),
    ("x", {ANNOTATION: "*"}, {}),
    ("x", {}, {"team-a": ["x"]}),
    ("x", {}, {"team-a": ["*"]}),
])
def test_allowed(tenant, annotations, extra):
    assert refusal("team-a", tenant, annotations, extra) is None


@pytest.mark.parametrize("tenant,annotations,extra", [
    ("b", {}, {}),
    ("b", {ANNOTATION: "bb, c"}, {}),
    ("b", {"other": "b"}, {"team-b": ["b"]}),
    ("team-a ", {}, {}),
])
def test_refused(tenant, annotations, extra):
    why = refusal("team-a", tenant, annotations, extra)
    assert why is not None and f"tenant {tenant!r} is not allowed in namespace 'team-a'" in why


def test_chart_value_parsing():
    assert _tenants('{"a": ["x", "y"]}') == {"a": ["x", "y"]}
    assert _tenants("") == {}
    with pytest.raises(ValueError):
        _tenants('{"a": "x"}')
