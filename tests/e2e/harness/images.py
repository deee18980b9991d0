"""The images the test node runs, built here because no registry is reachable.

* the **base** (``PYTHON_IMAGE`` of the Dockerfile): a Debian bookworm minbase root
  filesystem made by ``debootstrap`` from the machine's configured Debian mirror, with
  python3 and venv, written as an OCI image layout and cached under a key of its inputs;
* the **pause** image (the pod sandbox): ``pause/main.go`` compiled and put in a scratch
  image;
* **jobrunner** itself, from the repository's unchanged Dockerfile, by BuildKit straight
  into containerd's ``k8s.io`` namespace. The machine's CA bundle reaches pip as a build
  secret (never a layer); BuildKit's cache keeps a warm rebuild to a few seconds.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from . import build

REPO_ROOT = Path(__file__).resolve().parents[3]
PAUSE_SRC = Path(__file__).resolve().parent / "pause"

BASE_SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates")
# The name the Dockerfile's FROM resolves to (passed as its PYTHON_IMAGE build arg).
BASE_IMAGE = "localhost/jobrunner-e2e/python:3.11-bookworm"
PAUSE_IMAGE = "localhost/jobrunner-e2e/pause:1"
JOBRUNNER_IMAGE = "docker.io/library/jobrunner:e2e"  # `jobrunner:e2e` in a pod spec
CA_BUNDLE = Path(os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt")
# Paths a container never needs; dropping them keeps the base small.
_PRUNE = ("var/cache/apt", "var/lib/apt/lists", "usr/share/doc", "usr/share/man",
          "usr/share/info", "usr/share/locale", "usr/share/lintian", "var/log")


def _log(msg: str) -> None:
    print(f"[e2e-images] {msg}", file=sys.stderr, flush=True)


def debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (the only one it reaches)."""
    candidates = sorted(Path("/etc/apt/sources.list.d").glob("*.sources"))
    for f in candidates:
        for block in f.read_text().split("\n\n"):
            if re.search(r"^Suites:.*\bbookworm\b", block, re.M) and "security" not in block:
                m = re.search(r"^URIs:\s*(\S+)", block, re.M)
                if m:
                    return m.group(1)
    lst = Path("/etc/apt/sources.list")
    if lst.exists():
        for line in lst.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and "security" not in parts[1]:
                return parts[1]
    raise RuntimeError("no Debian mirror found in /etc/apt/sources.list{,.d}")


def base_key() -> str:
    inputs = json.dumps({"suite": BASE_SUITE, "packages": BASE_PACKAGES, "prune": _PRUNE,
                         "name": BASE_IMAGE, "layout": 2})
    return hashlib.sha256(inputs.encode()).hexdigest()[:16]


def base_layout_dir() -> Path:
    return build.cache_root() / f"base-{BASE_SUITE}-{base_key()}"


def _sha256_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest(), path.stat().st_size


def _blob(blobs: Path, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return "sha256:" + digest, len(data)


def write_oci_layout(rootfs: Path, out: Path, ref: str, history: str) -> str:
    """One-layer OCI image layout of ``rootfs``; returns the manifest digest."""
    blobs = out / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    layer_tar = out / "layer.tar"
    subprocess.run(["tar", "--numeric-owner", "--sort=name", "--mtime=@0", "--xattrs",
                    "-C", str(rootfs), "-cf", str(layer_tar), "."], check=True)
    diff_id, _ = _sha256_file(layer_tar)
    layer_gz = out / "layer.tar.gz"
    with open(layer_tar, "rb") as src, open(layer_gz, "wb") as raw, \
            gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) as gz:
        shutil.copyfileobj(src, gz, 1 << 20)
    layer_tar.unlink()
    layer_digest, layer_size = _sha256_file(layer_gz)
    layer_gz.rename(blobs / layer_digest.split(":", 1)[1])
    config = {
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                           "LANG=C.UTF-8"],
                   "Cmd": ["python3"]},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": history}],
    }
    cfg_digest, cfg_size = _blob(blobs, json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": cfg_digest, "size": cfg_size},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": layer_digest, "size": layer_size}],
    }
    man_digest, man_size = _blob(blobs, json.dumps(manifest, sort_keys=True).encode())
    (out / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    (out / "index.json").write_text(json.dumps({
        "schemaVersion": 2,
        "manifests": [{"mediaType": manifest["mediaType"], "digest": man_digest,
                       "size": man_size,
                       "annotations": {"org.opencontainers.image.ref.name": ref}}],
    }))
    return man_digest


def ensure_base() -> tuple[Path, str]:
    """The base image's OCI layout directory and manifest digest, made once per key."""
    out = base_layout_dir()
    stamp = out / ".complete"
    if stamp.exists():
        return out, json.loads(stamp.read_text())["manifest"]
    t0 = time.monotonic()
    work = out.with_name(out.name + ".work")
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    rootfs = work / "rootfs"
    rootfs.mkdir(parents=True)
    argv = ["debootstrap", "--variant=minbase", "--include=" + ",".join(BASE_PACKAGES),
            BASE_SUITE, str(rootfs), debian_mirror()]
    _log("$ " + " ".join(argv))
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"debootstrap failed ({r.returncode}):\n{r.stdout[-3000:]}"
                           f"\n{r.stderr[-3000:]}")
    for rel in _PRUNE:
        p = rootfs / rel
        if p.is_dir():
            for child in p.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
    out.mkdir(parents=True)
    digest = write_oci_layout(
        rootfs, out, ref=BASE_IMAGE.rsplit(":", 1)[1],
        history=f"debootstrap --variant=minbase --include={','.join(BASE_PACKAGES)} "
                f"{BASE_SUITE} (jobrunner e2e base)")
    shutil.rmtree(work, ignore_errors=True)
    stamp.write_text(json.dumps({"manifest": digest,
                                 "seconds": round(time.monotonic() - t0, 1)}))
    _log(f"base image {BASE_IMAGE} made in {time.monotonic() - t0:.0f}s ({digest[:19]})")
    return out, digest


def pause_binary() -> Path:
    out = build.cache_root() / "pause" / hashlib.sha256(
        (PAUSE_SRC / "main.go").read_bytes()).hexdigest()[:12]
    binary = out / "pause"
    if not binary.exists():
        out.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "CGO_ENABLED": "0", "GOTOOLCHAIN": "local", "GOFLAGS": ""}
        subprocess.run(["go", "build", "-trimpath", "-ldflags=-s -w", "-o", str(binary), "."],
                       cwd=PAUSE_SRC, env=env, check=True)
    return binary


class Builder:
    """``buildctl`` against a running buildkitd whose worker is the node's containerd."""

    def __init__(self, buildctl: Path, addr: str, logs: Path) -> None:
        self.buildctl, self.addr, self.logs = buildctl, addr, logs

    def _build(self, name: str, argv: list[str]) -> float:
        t0 = time.monotonic()
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"build-{name}.log"
        with open(log, "ab") as f:
            r = subprocess.run([str(self.buildctl), "--addr", self.addr, "build",
                                "--progress=plain", *argv], stdout=f, stderr=subprocess.STDOUT)
        if r.returncode != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            raise RuntimeError(f"image build of {name} failed:\n{tail}")
        return time.monotonic() - t0

    def build_pause(self) -> None:
        ctx = pause_binary().parent
        secs = self._build("pause", [
            "--frontend", "dockerfile.v0", "--opt", "cmdline=",
            "--local", f"context={ctx}", "--local", f"dockerfile={PAUSE_SRC}",
            "--output", f"type=image,name={PAUSE_IMAGE},unpack=true"])
        _log(f"pause image ready in {secs:.1f}s")

    def build_jobrunner(self, name: str = JOBRUNNER_IMAGE, context: Path = REPO_ROOT) -> None:
        """The repository's Dockerfile, as a user would build it, on the local base."""
        layout, digest = ensure_base()
        argv = [
            "--frontend", "dockerfile.v0", "--opt", "cmdline=",
            "--local", f"context={context}", "--local", f"dockerfile={context}",
            "--opt", f"build-arg:PYTHON_IMAGE={BASE_IMAGE}",
            "--oci-layout", f"base={layout}",
            "--opt", f"context:{BASE_IMAGE}=oci-layout://base@{digest}",
            "--output", f"type=image,name={name},unpack=true",
        ]
        if CA_BUNDLE.exists():
            argv += ["--secret", f"id=ca-certificates,src={CA_BUNDLE}"]
        secs = self._build("jobrunner", argv)
        _log(f"image {name} ready in {secs:.1f}s")


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        description="Rebuild the jobrunner image into a running test node (make cluster) "
                    "and print its size and layers.")
    ap.add_argument("--rebuild", action="store_true", help="build before printing")
    a = ap.parse_args(argv)
    from .node import Node, NodeError

    node = Node.attach()
    try:
        if a.rebuild:
            node.builder().build_jobrunner()
        info = node.image_info(JOBRUNNER_IMAGE)
    except NodeError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"{info['ref']}  {info['manifest']}\n"
          f"compressed size {info['compressed_bytes'] / 1e6:.1f} MB, "
          f"unpacked {info['unpacked_bytes'] / 1e6:.1f} MB, "
          f"user {info['user']}, entrypoint {info['entrypoint']}")
    for size, step in info["layers"]:
        print(f"  {size / 1e6:8.1f} MB  {step[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
