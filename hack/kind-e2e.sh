#!/usr/bin/env bash
# The kind recipe: a throw-away cluster, the image built and loaded into it, the chart
# installed with its demo PostgreSQL (NOT for production), the example BatchRun applied,
# and a wait until it has Succeeded.
#
#   hack/kind-e2e.sh          # or: make -C hack kind-e2e
#   hack/kind-e2e.sh down     # delete the cluster
#
# Needs docker, kind (>= 0.21), kubectl and helm (v3.8+ or v4) on PATH. Settings (env):
#   CLUSTER=jobrunner  NAMESPACE=jobrunner  RELEASE=jobrunner  IMAGE=jobrunner:dev
#   TIMEOUT=900 (seconds to wait for the BatchRun)   KEEP=1 (keep the cluster; default)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

CLUSTER=${CLUSTER:-jobrunner}
NAMESPACE=${NAMESPACE:-jobrunner}
RELEASE=${RELEASE:-jobrunner}
IMAGE=${IMAGE:-jobrunner:dev}
TIMEOUT=${TIMEOUT:-900}
CONTEXT="kind-${CLUSTER}"
EXAMPLE=examples/summarise.yaml
RUN=summarise-stdlib-docs

log() { printf '\n==> %s\n' "$*" >&2; }
need() {
  command -v "$1" >/dev/null 2>&1 || { echo "kind-e2e: '$1' is not on PATH ($2)" >&2; exit 2; }
}
k() { kubectl --context "$CONTEXT" "$@"; }

if [[ "${1:-up}" == "down" ]]; then
  need kind "https://kind.sigs.k8s.io"
  kind delete cluster --name "$CLUSTER"
  exit 0
fi

need docker "https://docs.docker.com/get-docker/"
need kind "https://kind.sigs.k8s.io"
need kubectl "https://kubernetes.io/docs/tasks/tools/"
need helm "https://helm.sh/docs/intro/install/"
docker info >/dev/null 2>&1 || { echo "kind-e2e: the Docker daemon is not reachable" >&2; exit 2; }

diagnose() {
  log "diagnostics"
  k -n "$NAMESPACE" get all,batchruns,secrets -o wide || true
  k -n "$NAMESPACE" describe batchrun "$RUN" || true
  k -n "$NAMESPACE" logs --tail=100 \
    -l "app.kubernetes.io/instance=${RELEASE},app.kubernetes.io/component=controller" || true
  k -n "$NAMESPACE" get events --sort-by=.lastTimestamp | tail -n 40 || true
}
on_exit() {
  local rc=$?
  if [[ $rc -ne 0 ]]; then diagnose; fi
  return "$rc"
}
trap on_exit EXIT

if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  log "kind cluster '$CLUSTER' exists: reusing it"
else
  log "creating kind cluster '$CLUSTER'"
  kind create cluster --name "$CLUSTER" --config hack/kind/cluster.yaml --wait 180s
fi

log "building $IMAGE"
docker build -t "$IMAGE" .
log "loading $IMAGE into the cluster's node(s)"
kind load docker-image "$IMAGE" --name "$CLUSTER"

# The chart: image from the node (pullPolicy Never: it was loaded, not pushed), the demo
# PostgreSQL writes the DSN Secret the controller and the workers read.
log "installing the chart (release $RELEASE, namespace $NAMESPACE)"
helm upgrade --install "$RELEASE" charts/jobrunner \
  --kube-context "$CONTEXT" --namespace "$NAMESPACE" --create-namespace \
  --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}" \
  --set image.pullPolicy=Never \
  --set postgresql.enabled=true \
  --wait --timeout 10m

log "applying $EXAMPLE"
k -n "$NAMESPACE" apply -f "$EXAMPLE"

log "waiting up to ${TIMEOUT}s for BatchRun/$RUN to succeed"
deadline=$((SECONDS + TIMEOUT))
phase=""
while ((SECONDS < deadline)); do
  phase=$(k -n "$NAMESPACE" get batchrun "$RUN" -o jsonpath='{.status.phase}' 2>/dev/null || true)
  case "$phase" in
    Succeeded) break ;;
    Failed|Cancelled)
      echo "kind-e2e: BatchRun/$RUN ended $phase:" >&2
      k -n "$NAMESPACE" get batchrun "$RUN" -o jsonpath='{.status.message}{"\n"}' >&2
      exit 1 ;;
  esac
  sleep 5
done
k -n "$NAMESPACE" get batchruns
if [[ "$phase" != "Succeeded" ]]; then
  echo "kind-e2e: BatchRun/$RUN is '${phase:-<no status>}' after ${TIMEOUT}s" >&2
  exit 1
fi
log "BatchRun/$RUN Succeeded. Cluster '$CLUSTER' kept: 'hack/kind-e2e.sh down' deletes it."
