"""The mutation check (hack/mutants.py) stays honest: every mutant still finds its
snippet in the source (a refactor that moves the code fails here, not silently), and a
CI-sized subset of the mutants is applied to a copy of the tree and killed by its tests.
The whole list runs with `hack/mutants.py` (its report: every mutant and its killer)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.figures import show
from tests.support.processes import REPO, child_env


def _mutants():
    spec = importlib.util.spec_from_file_location("mutants", REPO / "hack" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutants"] = module
    spec.loader.exec_module(module)
    return module


def test_every_mutant_finds_its_snippet_and_there_are_at_least_20():
    m = _mutants()
    assert m.check_all() == []
    assert len(m.MUTANTS) >= 20
    assert set(m.CI_SUBSET) <= {x.name for x in m.MUTANTS}


def test_a_snippet_that_moved_fails_loudly(tmp_path: Path):
    m = _mutants()
    mutant = m.MUTANTS[0]
    for edit in mutant.edits:
        target = tmp_path / edit.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("-- the code moved away\n")
    with pytest.raises(m.SnippetError, match="snippet not found"):
        m.apply(mutant, tmp_path)


@pytest.mark.slow
def test_the_ci_subset_of_mutants_is_killed(capsys):
    r = subprocess.run([sys.executable, str(REPO / "hack" / "mutants.py"), "--ci"], cwd=REPO,
                       env=child_env(), capture_output=True, text=True, timeout=1500)
    report = r.stdout[r.stdout.find("== mutation report =="):]
    show(capsys, report.strip())
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
