"""The WorkerPool's scaling decision (jobrunner/operator/scaling.py): pure logic, no cluster."""

from __future__ import annotations

import pytest

from jobrunner.operator.scaling import ScaleDown, decide, want_for

BASE = {"per_replica": 2, "min_replicas": 0, "max_replicas": 3, "window": 30.0}


def test_want_is_ceil_of_work_over_target_clamped():
    assert [want_for(w, 2, 0, 3) for w in (0, 1, 2, 3, 4, 5, 100)] == [0, 1, 1, 2, 2, 3, 3]
    assert want_for(0, 2, 1, 3) == 1
    assert want_for(-5, 2, 0, 3) == 0


def test_scales_up_at_once_and_says_why():
    d = decide(current=0, work=5, pending_down=None, now=100.0, **BASE)
    assert (d.desired, d.reason, d.pending_down) == (3, "WorkQueued", None)
    d = decide(current=1, work=50, pending_down=None, now=100.0, **BASE)
    assert (d.desired, d.reason) == (3, "AtMaxReplicas")
    d = decide(current=0, work=0, pending_down=None, now=100.0, **{**BASE, "min_replicas": 1})
    assert (d.desired, d.reason) == (1, "AtMinReplicas")


def test_scale_down_waits_the_whole_window_then_takes_the_most_wanted():
    d = decide(current=3, work=1, pending_down=None, now=100.0, **BASE)
    assert d.desired == 3 and d.reason == "StabilizationWindow"
    assert d.pending_down == ScaleDown(100.0, 1)
    # within the window the work wanted 2 for a moment: that is where it goes
    d = decide(current=3, work=4, pending_down=d.pending_down, now=110.0, **BASE)
    assert d.desired == 3 and d.pending_down == ScaleDown(100.0, 2)
    d = decide(current=3, work=0, pending_down=d.pending_down, now=129.9, **BASE)
    assert d.desired == 3 and d.reason == "StabilizationWindow"
    d = decide(current=3, work=0, pending_down=d.pending_down, now=130.0, **BASE)
    assert (d.desired, d.reason, d.pending_down) == (2, "ScaledDown", None)
    # the next window starts afresh, and ends at zero with nothing to do
    d = decide(current=2, work=0, pending_down=None, now=131.0, **BASE)
    d = decide(current=2, work=0, pending_down=d.pending_down, now=161.0, **BASE)
    assert (d.desired, d.reason) == (0, "NoWork")


def test_more_work_during_the_window_cancels_the_scale_down():
    d = decide(current=2, work=0, pending_down=None, now=0.0, **BASE)
    assert d.pending_down is not None
    d = decide(current=2, work=4, pending_down=d.pending_down, now=10.0, **BASE)
    assert (d.desired, d.pending_down) == (2, None)
    d = decide(current=2, work=0, pending_down=d.pending_down, now=35.0, **BASE)
    assert d.desired == 2 and d.pending_down == ScaleDown(35.0, 0)


def test_a_zero_window_scales_down_at_once_and_a_lowered_max_applies_at_once():
    d = decide(current=3, work=0, pending_down=None, now=0.0, **{**BASE, "window": 0.0})
    assert d.desired == 0
    d = decide(current=5, work=100, pending_down=None, now=0.0, **BASE)
    assert (d.desired, d.reason) == (3, "AtMaxReplicas")


@pytest.mark.parametrize("work", range(0, 40))
def test_desired_is_always_within_bounds(work):
    for current in range(0, 6):
        d = decide(current=current, work=work, pending_down=ScaleDown(0.0, 1), now=1e9,
                   **{**BASE, "min_replicas": 1})
        assert 1 <= d.desired <= 3
