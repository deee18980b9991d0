# The two commands a person needs on a fresh machine are `make demo` and `make test`.
# Everything else is a building block of those two.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint e2e-bins system-deps cluster bench kind-e2e clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[local,test]'
	touch $@

# The main job: a demo batch on an embedded PostgreSQL, with a progress bar and a summary,
# and the web console's address while it runs (docs/console.md).
demo: $(VENV)/.installed
	$(VENV)/bin/jobrunner run examples/summarise.yaml --console

# The whole test suite, with everything it needs (control-plane binaries built from Go
# modules and cached by version, PgBouncer from Debian). The e2e tests (one real cluster,
# shared by E2E_WORKERS pytest workers) run beside the rest, which uses TEST_WORKERS
# pytest-xdist workers: hack/test-suite.sh.
# The virtualenv and the Debian packages are made at once (both wait on the network),
# while hack/test-suite.sh already builds the Go binaries in the background (SETUP).
TEST_WORKERS ?= 2
test:
	PY=$(PY) PYTHON=$(PYTHON) TEST_WORKERS=$(TEST_WORKERS) \
	  SETUP="$(MAKE) -j2 --output-sync=line $(VENV)/.installed system-deps" hack/test-suite.sh

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

# (the standard library only: it needs no virtualenv and can build while pip installs)
e2e-bins:
	$(PYTHON) -m tests.e2e.harness.build

# Debian packages: PgBouncer, shellcheck and faketime (a worker whose clock is off by
# hours: tests/test_time_from_database.py) and chromium with its chromedriver (the
# console's browser tests drive the system's browser: tests/test_console_browser.py) for
# tests; runc, the CNI loopback plugin and debootstrap (the image's base) for the e2e
# node. Under CI=true a test that would skip for want of one of them fails instead
# (tests/conftest.py).
SYSTEM_PACKAGES := pgbouncer shellcheck faketime chromium chromium-driver runc \
                   containernetworking-plugins debootstrap
system-deps:
	@{ command -v pgbouncer && command -v shellcheck && command -v faketime && \
	   command -v chromium && command -v chromedriver && command -v runc && \
	   command -v debootstrap && test -x /usr/lib/cni/loopback; } >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq $(SYSTEM_PACKAGES) >/dev/null; \
	  else echo "missing: sudo apt-get install $(SYSTEM_PACKAGES)" >&2; exit 1; fi; }

# A real single-node cluster (control plane, containerd + kubelet, the image built from the
# Dockerfile) on 127.0.0.1 in the foreground; kubeconfig in .e2e/kubeconfig. Needs root.
cluster: $(VENV)/.installed system-deps e2e-bins
	$(PY) -m tests.e2e.harness.cluster

bench: $(VENV)/.installed system-deps e2e-bins
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m bench

# For a user with Docker and kind: a real cluster, the image, the chart, the example.
kind-e2e:
	hack/kind-e2e.sh

clean:
	rm -rf $(VENV) .e2e .pytest_cache .ruff_cache
