"""The mutation check (hack/mutants.py) stays honest: every mutant still finds its
snippet in the source (a refactor that moves the code fails here, not silently), and every
mutant is applied to a copy of the tree and killed by its tests, one test per mutant (the
same check as `hack/mutants.py`, whose table is the report; here the figure lines are)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.support.figures import show
from tests.support.processes import REPO


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


def test_a_snippet_that_moved_fails_loudly(tmp_path: Path):
    m = _mutants()
    mutant = m.MUTANTS[0]
    for edit in mutant.edits:
        target = tmp_path / edit.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("-- the code moved away\n")
    with pytest.raises(m.SnippetError, match="snippet not found"):
        m.apply(mutant, tmp_path)


@pytest.fixture(scope="session")
def unmutated_tree(tmp_path_factory) -> Path:
    """The tree as git knows it, copied once per pytest worker; each mutant copies it."""
    base = tmp_path_factory.mktemp("mutants-base") / "tree"
    _mutants().copy_tree(REPO, base)
    return base


# Every mutant is a test of its own, so pytest-xdist spreads the list over its workers
# beside the soaks; each prints its row of the report (the figures section of the CI log
# lists them all, with the test that killed each).
@pytest.mark.slow
@pytest.mark.parametrize("name", [m.name for m in _mutants().MUTANTS])
def test_the_mutant_is_killed_by_a_test(name: str, unmutated_tree: Path, capsys):
    m = _mutants()
    mutant = next(x for x in m.MUTANTS if x.name == name)
    outcome = m.run_mutant(mutant, unmutated_tree)
    verdict = f"killed by {outcome.killer}" if outcome.killed else outcome.killer
    show(capsys, f"mutant {name} ({mutant.guarantee}): {verdict} ({outcome.seconds:.0f} s)")
    assert outcome.killed, outcome.output[-6000:]
