"""pytest wiring for the e2e tests: the ``e2e`` marker and the session-scoped ``k8s`` fixture.

``k8s`` is a :class:`tests.e2e.harness.cluster.Cluster` (see tests/e2e/README.md):
``kubeconfig``, ``kubectl(*args, check=True, input=None)``, ``helm(*args)``,
``api_client()``, ``kubelet`` (``kill_pod``, ``pod_log``, ``pod_pids``),
``restart_apiserver()``, ``stop_apiserver()``/``start_apiserver()``, ``bin_dir``, ``env``.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from .harness import build

_HERE = Path(__file__).resolve().parent


# Set by hack/test-suite.sh: a cluster another process runs (its --info file), which
# several pytest processes share; unset, the session starts a cluster of its own.
SHARED_CLUSTER = os.environ.get("JOBRUNNER_E2E_CLUSTER", "")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "e2e: end-to-end test against a real kube-apiserver/controller-manager (tests/e2e)",
    )
    config.addinivalue_line(
        "markers",
        "exclusive: needs the cluster to itself (restarts its API server, or runs a "
        "cluster-wide controller): never run on a shared cluster (-m exclusive runs them)",
    )


def pytest_runtest_setup(item):
    if SHARED_CLUSTER and item.get_closest_marker("exclusive"):
        pytest.fail("an exclusive test cannot run on a shared cluster "
                    "(JOBRUNNER_E2E_CLUSTER is set): run it with -m exclusive alone",
                    pytrace=False)


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            p = Path(str(item.fspath)).resolve()
        except Exception:
            continue
        if _HERE in p.parents:
            item.add_marker(pytest.mark.e2e)


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def ensure_bin_dir() -> Path:
    """Binaries, built on demand; skip (or fail under CI=true) when they cannot be had."""
    if not build.cluster_present() and not build.go_available():
        msg = (
            "e2e binaries are not built and `go` is not installed "
            "(run `python -m tests.e2e.harness.build` on a machine with Go)"
        )
        if _in_ci():
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return build.ensure_cluster()


@pytest.fixture(scope="session")
def k8s():
    from .harness.cluster import Cluster

    if SHARED_CLUSTER:
        cluster = Cluster.attach(SHARED_CLUSTER)
        try:
            yield cluster
        finally:
            cluster.stop()
        return
    bin_dir = ensure_bin_dir()
    cluster = Cluster(bin_dir)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def namespace(k8s):
    """A fresh namespace, deleted (without waiting) after the test."""
    from .operator_support import create_namespace, release_rbac_guard

    name = create_namespace(k8s, "t-" + uuid.uuid4().hex[:8])
    yield name
    k8s.kubectl("delete", "namespace", name, "--wait=false", check=False)
    # The controller of the `operator` fixture is stopped by now: its guarded RoleBinding
    # would keep the namespace Terminating on the shared cluster.
    release_rbac_guard(k8s, name)


@pytest.fixture
def operator(k8s, namespace, dsn, tmp_path):
    """The BatchRun controller in a container (the chart's pod spec and RBAC) watching
    `namespace`, with the CRDs applied and the default database Secret pointing at the
    test's database."""
    from .operator_support import Controller, apply_crds, create_db_secret

    apply_crds(k8s)
    create_db_secret(k8s, namespace, dsn)
    controller = Controller(k8s, namespace, tmp_path / "controller.log").start()
    yield controller
    controller.stop()
