"""Build (or reuse) the Kubernetes control-plane binaries used by the e2e tests.

Everything is compiled from Go modules fetched through the Go module proxy with
the machine's ``go``; no release binaries are downloaded.

    python -m tests.e2e.harness.build          # builds if needed, prints the bin dir
    python -m tests.e2e.harness.build --force  # rebuild even if cached
    python -m tests.e2e.harness.build --only cluster   # what a cluster needs

Binaries land in ``$JOBRUNNER_E2E_CACHE`` (default ``~/.cache/jobrunner-e2e``):

    k8s-<K8S_VERSION>/bin/{kube-apiserver,kube-controller-manager,kubectl,etcd}
    helm-<HELM_VERSION>/bin/helm
    kueue-<KUEUE_VERSION>/bin/kueue, kueue-<KUEUE_VERSION>/assets/config/components/{crd,webhook}
    jaeger-<JAEGER_VERSION>/bin/jaeger
    prometheus-<PROMETHEUS_VERSION>/bin/{prometheus,promtool}
    bin-k8s-<K8S_VERSION>-helm-<HELM_VERSION>/   (symlinks to all of the above; printed)

Versions are pinned here and only here.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

# ---- the one place where versions are pinned ---------------------------------
K8S_VERSION = "v1.37.2"  # newest k8s.io/kubernetes that builds with Go 1.26
HELM_VERSION = "v4.3.2"  # helm.sh/helm/v4 (built against k8s.io/* v0.37.2)
CONTAINERD_VERSION = "v2.4.2"  # github.com/containerd/containerd/v2
BUILDKIT_VERSION = "v0.34.2"  # github.com/moby/buildkit
KUEUE_VERSION = "v0.17.0"  # sigs.k8s.io/kueue (cmd/kueue; its CRDs come from the same module)
JAEGER_VERSION = "v1.75.0"  # github.com/jaegertracing/jaeger (cmd/jaeger: the trace store of tests)
# github.com/prometheus/prometheus (Prometheus v3.16.0's module version): promtool checks and
# tests the chart's alert rules (tests/test_alerts.py)
PROMETHEUS_VERSION = "v0.316.0"
# etcd is go.etcd.io/etcd/server/v3 at the version k8s.io/kubernetes itself requires.
# runc, the CNI loopback plugin and debootstrap are Debian packages (`make system-deps`).
# -------------------------------------------------------------------------------

K8S_BINARIES = (
    "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl", "etcd",
)
HELM_BINARIES = ("helm",)
CONTAINERD_BINARIES = ("containerd", "containerd-shim-runc-v2", "ctr")
BUILDKIT_BINARIES = ("buildkitd", "buildctl")
KUEUE_BINARIES = ("kueue",)
JAEGER_BINARIES = ("jaeger",)
PROMETHEUS_BINARIES = ("prometheus", "promtool")
ALL_BINARIES = (K8S_BINARIES + HELM_BINARIES + CONTAINERD_BINARIES + BUILDKIT_BINARIES
                + KUEUE_BINARIES + JAEGER_BINARIES + PROMETHEUS_BINARIES)


class GoModule:
    """A plain Go module whose main packages build without replace directives of their own."""

    def __init__(self, name: str, module: str, version: str, packages: tuple[str, ...],
                 binaries: tuple[str, ...], version_vars: tuple[str, ...],
                 assets: tuple[str, ...] = (), tags: tuple[str, ...] = ()) -> None:
        self.name, self.module, self.version = name, module, version
        self.tags = tags
        self.packages, self.binaries, self.version_vars = packages, binaries, version_vars
        # Folders of the module's source copied beside the binaries (CRDs, manifests).
        self.assets = assets

    def dir(self) -> Path:
        return cache_root() / f"{self.name}-{self.version}"

    def assets_dir(self) -> Path:
        return self.dir() / "assets"


CONTAINERD = GoModule(
    "containerd", "github.com/containerd/containerd/v2", CONTAINERD_VERSION,
    ("cmd/containerd", "cmd/containerd-shim-runc-v2", "cmd/ctr"), CONTAINERD_BINARIES,
    ("github.com/containerd/containerd/v2/version.Version",),
)
BUILDKIT = GoModule(
    "buildkit", "github.com/moby/buildkit", BUILDKIT_VERSION,
    ("cmd/buildkitd", "cmd/buildctl"), BUILDKIT_BINARIES,
    ("github.com/moby/buildkit/version.Version",),
)
KUEUE = GoModule(
    "kueue", "sigs.k8s.io/kueue", KUEUE_VERSION, ("cmd/kueue",), KUEUE_BINARIES,
    ("sigs.k8s.io/kueue/pkg/version.GitVersion",),
    # its CRDs (and their conversion-webhook patches) and webhook configurations
    ("config/components/crd", "config/components/webhook"),
)

# Jaeger's all-in-one (OTLP receiver, in-memory store, query API): tests/test_tracing_jaeger.py.
JAEGER = GoModule(
    "jaeger", "github.com/jaegertracing/jaeger", JAEGER_VERSION, ("cmd/jaeger",),
    JAEGER_BINARIES, (),
)

# Without its service-discovery plugins (cloud SDKs, client-go: most of its compile time):
# the tests scrape static and file targets, which are not plugins.
PROMETHEUS = GoModule(
    "prometheus", "github.com/prometheus/prometheus", PROMETHEUS_VERSION,
    ("cmd/prometheus", "cmd/promtool"), PROMETHEUS_BINARIES,
    ("github.com/prometheus/common/version.Version",), tags=("remove_all_sd",),
)

_STAMP = ".complete"


def cache_root() -> Path:
    root = os.environ.get("JOBRUNNER_E2E_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "jobrunner-e2e"


def k8s_dir() -> Path:
    return cache_root() / f"k8s-{K8S_VERSION}"


def helm_dir() -> Path:
    return cache_root() / f"helm-{HELM_VERSION}"


def bin_dir() -> Path:
    """The directory holding (symlinks to) every binary the harness uses."""
    return cache_root() / (f"bin-k8s-{K8S_VERSION}-helm-{HELM_VERSION}"
                           f"-containerd-{CONTAINERD_VERSION}-buildkit-{BUILDKIT_VERSION}"
                           f"-kueue-{KUEUE_VERSION}-jaeger-{JAEGER_VERSION}"
                           f"-prometheus-{PROMETHEUS_VERSION}")


def _complete(d: Path, names) -> bool:
    return (d / _STAMP).exists() and all(os.access(d / "bin" / n, os.X_OK) for n in names)


def binaries_present(names: tuple[str, ...] = ALL_BINARIES) -> bool:
    b = bin_dir()
    return all(os.access(b / n, os.X_OK) for n in names)


def cluster_present() -> bool:
    return binaries_present(K8S_BINARIES + HELM_BINARIES + CONTAINERD_BINARIES
                            + BUILDKIT_BINARIES)


def go_available() -> bool:
    return shutil.which("go") is not None


def _log(msg: str) -> None:
    print(f"[e2e-build] {msg}", file=sys.stderr, flush=True)


def _go_env() -> dict:
    env = dict(os.environ)
    env.setdefault("GOTOOLCHAIN", "local")
    env["GOFLAGS"] = "-mod=mod -buildvcs=false"
    env["CGO_ENABLED"] = "0"
    return env


def _run(cmd, cwd: Path, capture: bool = False) -> str:
    _log("$ " + " ".join(str(c) for c in cmd) + f"   (in {cwd})")
    res = subprocess.run(
        [str(c) for c in cmd],
        cwd=str(cwd),
        env=_go_env(),
        check=False,
        stdout=subprocess.PIPE if capture else None,
        text=True,
    )
    if res.returncode != 0:
        raise SystemExit(f"command failed ({res.returncode}): {' '.join(map(str, cmd))}")
    return res.stdout if capture else ""


def _mod_download(module: str, cwd: Path) -> dict:
    out = _run(["go", "mod", "download", "-json", module], cwd, capture=True)
    return json.loads(out)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def build_k8s(force: bool = False) -> Path:
    d = k8s_dir()
    if not force and _complete(d, K8S_BINARIES):
        return d / "bin"
    t0 = time.monotonic()
    src = d / "src"
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    # A throw-away module so that `go mod download` has somewhere to run.
    _write(src / "go.mod", "module jobrunner.test/k8sbuild\n\ngo 1.26.0\n")
    info = _mod_download(f"k8s.io/kubernetes@{K8S_VERSION}", src)
    upstream_mod = Path(info["GoMod"]).read_text()
    commit = (info.get("Origin") or {}).get("Hash", "")
    # The upstream go.mod replaces each staging module by a directory that is not
    # part of the module zip; map each to its published v0.X.Y twin instead.
    staging_version = "v0." + K8S_VERSION[len("v1.") :]
    staging = sorted(
        set(re.findall(r"^\s*(k8s\.io/[\w.\-/]+)\s*=>\s*\./staging/", upstream_mod, re.M))
    )
    if not staging:
        raise SystemExit("could not find staging replace directives in k8s.io/kubernetes go.mod")
    etcd_ver = re.search(r"^\s*go\.etcd\.io/etcd/server/v3\s+(v\S+)", upstream_mod, re.M)
    if not etcd_ver:
        raise SystemExit("could not find go.etcd.io/etcd/server/v3 in k8s.io/kubernetes go.mod")
    etcd_version = etcd_ver.group(1)
    replaces = "\n".join(f"\t{m} => {m} {staging_version}" for m in staging)
    _write(
        src / "go.mod",
        f"""module jobrunner.test/k8sbuild

go 1.26.0

godebug default=go1.26

require (
\tk8s.io/kubernetes {K8S_VERSION}
\tgo.etcd.io/etcd/server/v3 {etcd_version}
)

replace (
{replaces}
)
""",
    )
    # etcd's own main package lives in a module whose replace directives point at
    # sibling directories too; its main() is a one-liner around etcdmain.Main.
    _write(
        src / "etcd" / "main.go",
        """package main

import (
\t"os"

\t"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
""",
    )
    _write(
        src / "tools.go",
        """//go:build tools

package tools

import (
\t_ "k8s.io/kubernetes/cmd/kube-apiserver"
\t_ "k8s.io/kubernetes/cmd/kube-controller-manager"
\t_ "k8s.io/kubernetes/cmd/kubectl"
)
""",
    )
    _run(["go", "mod", "tidy"], src)
    # Make the binaries report the right version (kubectl version skew checks).
    major, minor = K8S_VERSION[1:].split(".")[:2]
    build_date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    xs = {
        "gitVersion": K8S_VERSION,
        "gitMajor": major,
        "gitMinor": minor,
        "gitCommit": commit,
        "gitTreeState": "clean",
        "buildDate": build_date,
    }
    ldflags = ["-s", "-w"]
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        for k, v in xs.items():
            ldflags.append(f"-X={pkg}.{k}={v}")
    out = d / "bin"
    out.mkdir(parents=True, exist_ok=True)
    (d / _STAMP).unlink(missing_ok=True)
    _run(
        [
            "go",
            "build",
            "-trimpath",
            "-ldflags=" + " ".join(ldflags),
            "-o",
            str(out) + "/",
            "k8s.io/kubernetes/cmd/kube-apiserver",
            "k8s.io/kubernetes/cmd/kube-controller-manager",
            "k8s.io/kubernetes/cmd/kube-scheduler",
            "k8s.io/kubernetes/cmd/kubelet",
            "k8s.io/kubernetes/cmd/kubectl",
            "./etcd",
        ],
        src,
    )
    secs = time.monotonic() - t0
    _write(
        d / _STAMP,
        json.dumps(
            {
                "k8s": K8S_VERSION,
                "etcd": etcd_version,
                "commit": commit,
                "seconds": round(secs, 1),
                "built": build_date,
            }
        )
        + "\n",
    )
    _log(f"kubernetes {K8S_VERSION} (+etcd {etcd_version}) built in {secs:.0f}s")
    return out


def build_helm(force: bool = False) -> Path:
    d = helm_dir()
    if not force and _complete(d, HELM_BINARIES):
        return d / "bin"
    t0 = time.monotonic()
    major = HELM_VERSION.split(".")[0]  # v3 / v4
    mod = f"helm.sh/helm/{major}"
    src = d / "src"
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    _write(
        src / "go.mod",
        f"module jobrunner.test/helmbuild\n\ngo 1.26.0\n\nrequire {mod} {HELM_VERSION}\n",
    )
    _write(src / "tools.go", f'//go:build tools\n\npackage tools\n\nimport _ "{mod}/cmd/helm"\n')
    _run(["go", "mod", "tidy"], src)
    info = _mod_download(f"{mod}@{HELM_VERSION}", src)
    commit = (info.get("Origin") or {}).get("Hash", "")
    ldflags = [
        "-s",
        "-w",
        f"-X={mod}/internal/version.version={HELM_VERSION}",
        f"-X={mod}/internal/version.gitCommit={commit}",
        "-X=" + mod + "/internal/version.gitTreeState=clean",
    ]
    out = d / "bin"
    out.mkdir(parents=True, exist_ok=True)
    (d / _STAMP).unlink(missing_ok=True)
    _run(
        [
            "go",
            "build",
            "-trimpath",
            "-ldflags=" + " ".join(ldflags),
            "-o",
            str(out) + "/",
            f"{mod}/cmd/helm",
        ],
        src,
    )
    secs = time.monotonic() - t0
    _write(
        d / _STAMP,
        json.dumps({"helm": HELM_VERSION, "commit": commit, "seconds": round(secs, 1)}) + "\n",
    )
    _log(f"helm {HELM_VERSION} built in {secs:.0f}s")
    return out


def _copy_assets(m: GoModule, module_dir: Path) -> None:
    tmp = m.dir() / "assets.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for sub in m.assets:
        shutil.copytree(module_dir / sub, tmp / sub)
    for p in tmp.rglob("*"):  # (the module cache is read-only)
        p.chmod(0o755 if p.is_dir() else 0o644)
    shutil.rmtree(m.assets_dir(), ignore_errors=True)
    tmp.replace(m.assets_dir())


def build_module(m: GoModule, force: bool = False) -> Path:
    d = m.dir()
    if not force and _complete(d, m.binaries):
        if m.assets and not m.assets_dir().is_dir():
            src = d / "src"
            _copy_assets(m, Path(_mod_download(f"{m.module}@{m.version}", src)["Dir"]))
        return d / "bin"
    t0 = time.monotonic()
    src = d / "src"
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    imports = "\n".join(f'\t_ "{m.module}/{p}"' for p in m.packages)
    _write(src / "go.mod", f"module jobrunner.test/{m.name}build\n\ngo 1.26.0\n\n"
                           f"require {m.module} {m.version}\n")
    _write(src / "tools.go", f"//go:build tools\n\npackage tools\n\nimport (\n{imports}\n)\n")
    _run(["go", "mod", "tidy"], src)
    info = _mod_download(f"{m.module}@{m.version}", src)
    commit = (info.get("Origin") or {}).get("Hash", "")
    if m.assets:
        _copy_assets(m, Path(info["Dir"]))
    ldflags = ["-s", "-w", *(f"-X={v}={m.version}" for v in m.version_vars)]
    out = d / "bin"
    out.mkdir(parents=True, exist_ok=True)
    (d / _STAMP).unlink(missing_ok=True)
    tags = [f"-tags={','.join(m.tags)}"] if m.tags else []
    _run(["go", "build", "-trimpath", *tags, "-ldflags=" + " ".join(ldflags),
          "-o", str(out) + "/", *(f"{m.module}/{p}" for p in m.packages)], src)
    secs = time.monotonic() - t0
    _write(d / _STAMP, json.dumps({m.name: m.version, "commit": commit,
                                   "seconds": round(secs, 1)}) + "\n")
    _log(f"{m.name} {m.version} built in {secs:.0f}s")
    return out


# Every part, in the order a full build makes them: the cluster's first (the e2e tests
# wait for those), then the binaries only some tests use.
PARTS: dict[str, tuple[tuple[str, ...], Callable[[bool], Path]]] = {
    "k8s": (K8S_BINARIES, build_k8s),
    "helm": (HELM_BINARIES, build_helm),
    "containerd": (CONTAINERD_BINARIES, lambda force: build_module(CONTAINERD, force)),
    "buildkit": (BUILDKIT_BINARIES, lambda force: build_module(BUILDKIT, force)),
    "kueue": (KUEUE_BINARIES, lambda force: build_module(KUEUE, force)),
    "jaeger": (JAEGER_BINARIES, lambda force: build_module(JAEGER, force)),
    "prometheus": (PROMETHEUS_BINARIES, lambda force: build_module(PROMETHEUS, force)),
}
CLUSTER_PARTS = ("k8s", "helm", "containerd", "buildkit")


@contextmanager
def _flock(name: str) -> Iterator[None]:
    cache_root().mkdir(parents=True, exist_ok=True)
    with open(cache_root() / name, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def ensure(part: str, force: bool = False) -> Path:
    """The part's binaries (built if missing) and the combined bin dir linking them.

    Each part has a lock of its own, so whoever needs a part (the suite's background
    builder, a test, a person) waits while another process builds it and then finds it
    built; compiling takes one more lock, shared by all parts, so that two parts never
    compile at once on the machine's cores."""
    names, build = PARTS[part]
    with _flock(f".lock-{part}"):
        d = build(False) if not force and _part_ready(part) else None
        if d is None:
            t0 = time.monotonic()
            with _flock(".lock"):
                d = build(force)
            _log(f"{part} ready in {time.monotonic() - t0:.1f}s")
        _link({names: d})
    return bin_dir()


def _part_ready(part: str) -> bool:
    names, _ = PARTS[part]
    if part == "k8s":
        return _complete(k8s_dir(), names)
    if part == "helm":
        return _complete(helm_dir(), names)
    m = {"containerd": CONTAINERD, "buildkit": BUILDKIT, "kueue": KUEUE, "jaeger": JAEGER,
         "prometheus": PROMETHEUS}[part]
    return _complete(m.dir(), names) and (not m.assets or m.assets_dir().is_dir())


def part_binary(part: str, name: str) -> Path:
    """Where the part's binary `name` lands (built or not)."""
    names, _ = PARTS[part]
    assert name in names, (part, name)
    return bin_dir() / name


def can_have(part: str, name: str) -> bool:
    """Built, or buildable here: a cheap check for a test's collection time."""
    return os.access(part_binary(part, name), os.X_OK) or go_available()


def binary(part: str, name: str) -> Path | None:
    """The binary, built first if it is missing (`make test` builds it in the background
    while the suite runs: this waits for that build), or None without Go to build it."""
    if not can_have(part, name):
        return None
    ensure(part)
    return part_binary(part, name)


def ensure_cluster(force: bool = False) -> Path:
    """What a cluster needs (control plane, node, image builder, helm)."""
    for part in CLUSTER_PARTS:
        ensure(part, force)
    return bin_dir()


def ensure_binaries(force: bool = False) -> Path:
    """Build whatever is missing, cluster first, and return the combined bin dir."""
    t0 = time.monotonic()
    for part in PARTS:
        ensure(part, force)
    _log(f"binaries ready in {time.monotonic() - t0:.1f}s")
    return bin_dir()


def _link(dirs: dict[tuple[str, ...], Path]) -> None:
    b = bin_dir()
    b.mkdir(parents=True, exist_ok=True)
    for names, src_dir in dirs.items():
        for n in names:
            link = b / n
            if link.is_symlink() or link.exists():
                if link.resolve() == (src_dir / n).resolve():
                    continue
                link.unlink()
            link.symlink_to(src_dir / n)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--force", action="store_true", help="rebuild even if cached binaries exist")
    p.add_argument("--print-versions", action="store_true", help="print pinned versions and exit")
    p.add_argument("--only", help="comma-separated parts (cluster, or any of: "
                   + ", ".join(PARTS) + "); default: all, cluster first")
    a = p.parse_args(argv)
    if a.print_versions:
        print(f"kubernetes {K8S_VERSION}\nhelm {HELM_VERSION}\ncontainerd {CONTAINERD_VERSION}\n"
              f"buildkit {BUILDKIT_VERSION}\nkueue {KUEUE_VERSION}\njaeger {JAEGER_VERSION}"
              f"\nprometheus {PROMETHEUS_VERSION}")
        return 0
    if not go_available() and not binaries_present():
        print("go is not installed and the e2e binaries are not cached", file=sys.stderr)
        return 2
    if a.only:
        parts = [q for part in a.only.split(",")
                 for q in (CLUSTER_PARTS if part == "cluster" else (part,))]
        unknown = sorted(set(parts) - set(PARTS))
        if unknown:
            p.error(f"unknown part(s): {', '.join(unknown)}")
        for part in parts:
            ensure(part, a.force)
        print(bin_dir())
        return 0
    print(ensure_binaries(force=a.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
