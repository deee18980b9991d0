# syntax=docker/dockerfile:1
# One image for both halves of jobrunner:
#   controller:  jobrunner-controller --namespace NS          (the Helm chart's Deployment)
#   worker:      jobrunner worker --batch B --handler M:F     (the Jobs the controller creates)
# The example handlers live in /app/examples (PYTHONPATH=/app), so
# `handler: examples.summarise.handler:summarise_chunk` works out of the box.
#
# Build:  docker build -t jobrunner:dev .
# Runs as UID 10001 with a read-only root filesystem (mount an emptyDir on /tmp).
# The base is pinned to an exact patch release; pin its digest as well in your registry
# mirror (python:3.12.8-slim-bookworm@sha256:...) if you need byte-for-byte rebuilds.

ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm

# ---------------------------------------------------------------- build stage
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# Only what the wheel needs (see .dockerignore): no tests, no bench, no charts.
COPY pyproject.toml README.md ./
COPY jobrunner/ jobrunner/
COPY sql/ sql/
COPY crds/ crds/
# The core and the `otel` extra (the OpenTelemetry SDK and OTLP/HTTP exporter: 7.3 MB more
# venv unpacked, 1.7 MB compressed): a worker or controller pod traces when its OTEL_*
# environment asks (docs/observability.md) without a custom image; without OTEL_* the SDK
# is never imported. Not the embedded PostgreSQL ([local] extra): that is for laptops.
# No `kubernetes` package: the controller talks to the API with httpx (jobrunner/operator/kube.py)
# and kopf logs in by itself. Dropped after the install: the venv's setuptools.
# Third-party packages are kept as bytecode alone (their sources are read only by
# tracebacks, which still name file and line): that halves the files and about 40 MB.
# jobrunner's own code keeps its sources, and so does anyio (it reads its own source to
# resolve lazy imports).
# All dependencies ship binary wheels (psycopg[binary]), so no compiler is needed.
# A network that re-signs TLS needs its CA bundle for pip: pass it as a build secret
# (`--secret id=ca-certificates,src=/etc/ssl/certs/ca-certificates.crt`); it is mounted
# for this step only and never stored in a layer. Without the secret pip uses its own.
RUN --mount=type=secret,id=ca-certificates,required=false \
    if [ -s /run/secrets/ca-certificates ]; then export PIP_CERT=/run/secrets/ca-certificates; fi \
 && python -m venv /opt/venv \
 && /opt/venv/bin/pip install --upgrade pip \
 && /opt/venv/bin/pip install '.[otel]' \
 && /opt/venv/bin/pip uninstall -y pip \
 && site=$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
 && rm -rf "$site/setuptools" "$site/pkg_resources" \
           "$site/_distutils_hack" "$site/distutils-precedence.pth" "$site"/setuptools-*.dist-info \
 && find "$site" -name __pycache__ -prune -exec rm -rf {} + \
 && /opt/venv/bin/python -m compileall -q -b -l "$site" >/dev/null \
 && for pkg in "$site"/*/; do \
      case "$(basename "$pkg")" in \
        jobrunner|anyio|*.dist-info) ;; \
        *) /opt/venv/bin/python -m compileall -q -b "$pkg" >/dev/null ;; \
      esac; \
    done \
 && find "$site" -name '*.py' -not -path "$site/jobrunner/*" \
      -not -path "$site/anyio/*" -delete \
 && /opt/venv/bin/python -m compileall -q "$site/jobrunner" "$site/anyio" \
 && PYTHONPATH= /opt/venv/bin/python -c 'import jobrunner.cli, jobrunner.operator.main, kopf, httpx, psycopg, rich, typer, opentelemetry.sdk.trace, opentelemetry.exporter.otlp.proto.http.trace_exporter' \
 && if PYTHONPATH= /opt/venv/bin/python -c 'import kubernetes' 2>/dev/null; then \
      echo "the kubernetes package is in the image; nothing here should need it" >&2; exit 1; fi \
 && /opt/venv/bin/jobrunner --help >/dev/null

# ---------------------------------------------------------------- final stage
FROM ${PYTHON_IMAGE} AS final
LABEL org.opencontainers.image.title="jobrunner" \
      org.opencontainers.image.description="Kubernetes-native batch runner with a PostgreSQL queue: controller and worker" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 jobrunner \
 && useradd --system --uid 10001 --gid 10001 --home-dir /app --no-create-home \
      --shell /usr/sbin/nologin jobrunner
COPY --from=build /opt/venv /opt/venv
COPY --chown=root:root examples/ /app/examples/
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
WORKDIR /app
# Numeric UID so that Kubernetes can verify runAsNonRoot.
USER 10001:10001
ENTRYPOINT ["jobrunner"]
CMD ["--help"]
