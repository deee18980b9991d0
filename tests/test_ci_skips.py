"""Under CI=true a skip fails (tests/conftest.py): a test, a module skipped at import,
and a fixture that skips; outside CI they stay skips."""

from __future__ import annotations

import subprocess
import sys

from tests.support.processes import REPO, child_env

SKIPPING = '''
import pytest

@pytest.fixture
def needs_a_tool():
    pytest.skip("the tool is not installed")

def test_skips():
    pytest.skip("no reason to run")

def test_skips_in_a_fixture(needs_a_tool):
    pass

@pytest.mark.xfail(reason="an expected failure is not a skip")
def test_xfails():
    raise AssertionError

def test_runs():
    pass
'''
SKIPPED_MODULE = 'import pytest\npytest.importorskip("no_such_module_jobrunner")\n'


def _pytest(tmp_path, ci: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    (tmp_path / "test_skipped_module.py").write_text(SKIPPED_MODULE)
    env = child_env(CI=ci)
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-q",
                           "-p", "no:cacheprovider", "-n", "0", "--rootdir", str(tmp_path),
                           "--continue-on-collection-errors",
                           str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_every_skip_fails_under_ci(tmp_path):
    r = _pytest(tmp_path, "true")
    assert r.returncode == 1, r.stdout[-3000:]
    # (a skip in a fixture fails its setup: an error, as a skipped module is)
    assert "1 failed, 1 passed, 1 xfailed, 2 errors" in r.stdout, r.stdout[-3000:]
    assert r.stdout.count("skipped under CI=true, which allows no skip") >= 3, r.stdout[-3000:]
    assert "the tool is not installed" in r.stdout and "no_such_module_jobrunner" in r.stdout


def test_skips_stay_skips_outside_ci(tmp_path):
    r = _pytest(tmp_path, "")
    assert r.returncode == 0, r.stdout[-3000:]
    assert "1 passed, 3 skipped, 1 xfailed" in r.stdout, r.stdout[-3000:]
