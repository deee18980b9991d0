{{/* Names, labels and the small computations shared by the templates. */}}

{{- define "jobrunner.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "jobrunner.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "jobrunner.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "jobrunner.selectorLabels" -}}
app.kubernetes.io/name: {{ include "jobrunner.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "jobrunner.labels" -}}
helm.sh/chart: {{ include "jobrunner.chart" . }}
{{ include "jobrunner.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: jobrunner
{{- end -}}

{{- define "jobrunner.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "jobrunner.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "jobrunner.peeringName" -}}
{{- default (include "jobrunner.fullname" .) .Values.peering.name -}}
{{- end -}}

{{- define "jobrunner.workerServiceAccountName" -}}
{{- if .Values.worker.serviceAccount.create -}}
{{- default (printf "%s-worker" (include "jobrunner.fullname" .)) .Values.worker.serviceAccount.name -}}
{{- else -}}
{{- .Values.worker.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The controller image reference: repository[:tag][@digest]. */}}
{{- define "jobrunner.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* The watched namespaces, as a JSON list (empty when cluster-wide). */}}
{{- define "jobrunner.watchNamespaces" -}}
{{- if .Values.watch.clusterWide -}}
{{- list | toJson -}}
{{- else if .Values.watch.namespaces -}}
{{- .Values.watch.namespaces | uniq | toJson -}}
{{- else -}}
{{- list .Release.Namespace | toJson -}}
{{- end -}}
{{- end -}}

{{/* Watched namespaces other than the release's, as a JSON list: the controller's
RoleBinding there binds a ClusterRole and carries the finalizer
jobrunner.dev/controller-access, so that deleting the namespace cannot take the
controller's access before its finalizers ran (docs/operator.md, "Deleting a watched
namespace"). The release namespace needs no guard: the controller runs there and goes
with it. Empty when cluster-wide or when the chart creates no RBAC. */}}
{{- define "jobrunner.guardedNamespaces" -}}
{{- $out := list -}}
{{- if and .Values.rbac.create (not .Values.watch.clusterWide) -}}
{{- range $ns := include "jobrunner.watchNamespaces" . | fromJsonArray -}}
{{- if ne $ns $.Release.Namespace -}}
{{- $out = append $out $ns -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $out | toJson -}}
{{- end -}}

{{/* The name of that guarded RoleBinding (not the release namespace Role's name: a
RoleBinding's roleRef cannot change, so an upgrade from a chart that bound a Role there
replaces the binding instead of failing). */}}
{{- define "jobrunner.guardName" -}}
{{- printf "%s-controller" (include "jobrunner.fullname" .) -}}
{{- end -}}

{{/* Namespaces that get per-namespace objects (the DSN Secret of the demo database, the
worker ServiceAccount): the watched ones, or the release namespace when cluster-wide. */}}
{{- define "jobrunner.runNamespaces" -}}
{{- if .Values.watch.clusterWide -}}
{{- list .Release.Namespace | toJson -}}
{{- else -}}
{{- include "jobrunner.watchNamespaces" . -}}
{{- end -}}
{{- end -}}

{{/*
The controller's permissions, and nothing more (see docs/operator.md):
BatchRuns it watches and patches (kopf's annotations and finalizer), their status, their
finalizers subresource (ownerReferences with blockOwnerDeletion on the Jobs it creates),
Jobs it reads/creates/patches (parallelism, suspend; garbage collection deletes them),
Events, pods read-only, the database Secret (get only, never list) and kopf peering.
Argument: dict "root" (the chart context) and "peering" (kopfpeerings or
clusterkopfpeerings, or "" for none).
*/}}
{{- define "jobrunner.controllerRules" -}}
{{- $root := .root -}}
- apiGroups: [jobrunner.dev]
  resources: [batchruns]
  verbs: [get, list, watch, patch, create, delete]
- apiGroups: [jobrunner.dev]
  resources: [batchrunschedules]
  verbs: [get, list, watch, patch]
- apiGroups: [jobrunner.dev]
  resources: [batchrunschedules/status]
  verbs: [get, patch, update]
- apiGroups: [jobrunner.dev]
  resources: [batchrunschedules/finalizers]
  verbs: [update]
- apiGroups: [jobrunner.dev]
  resources: [batchruns/status]
  verbs: [get, patch, update]
- apiGroups: [jobrunner.dev]
  resources: [batchruns/finalizers]
  verbs: [update]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, create, patch]
# WorkerPools: the controller runs each one's Deployment and sets its replicas.
- apiGroups: [jobrunner.dev]
  resources: [workerpools]
  verbs: [get, list, watch, patch]
- apiGroups: [jobrunner.dev]
  resources: [workerpools/status]
  verbs: [get, patch, update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
  {{- with $root.Values.rbac.secretNames }}
  resourceNames: {{ toJson . }}
  {{- end }}
# A BatchRun's source.configMap: its JSON lines are read once, when the run is enqueued.
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get]
{{- if $root.Values.tenancy.bindToNamespaces }}
# Tenants bound to namespaces: the namespace's jobrunner.dev/tenants annotation. In a Role
# this is the watched namespace's own object only (a request for namespace X is filed
# under namespace X).
- apiGroups: [""]
  resources: [namespaces]
  verbs: [get]
{{- end }}
{{- if $root.Values.kueue.enabled }}
# Kueue: a run's admission is read from its Job's Workload; deactivating the Workload
# (spec.active) is how the controller stops the workers of a Job Kueue admits.
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [get, list, watch, patch]
{{- end }}
{{- with .guard }}
# Its own guarded RoleBinding, by name: to drop the binding's finalizer once nothing in the
# namespace needs the controller any more (operator/rbacguard.py).
- apiGroups: [rbac.authorization.k8s.io]
  resources: [rolebindings]
  verbs: [get, patch]
  resourceNames: [{{ . | quote }}]
{{- end }}
{{- if .peering }}
- apiGroups: [kopf.dev]
  resources: [{{ .peering }}]
  verbs: [list, watch]
- apiGroups: [kopf.dev]
  resources: [{{ .peering }}]
  verbs: [get, patch]
  resourceNames: [{{ include "jobrunner.peeringName" $root | quote }}]
{{- end }}
{{- end -}}
