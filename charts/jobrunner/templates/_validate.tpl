{{/* Rules values.schema.json cannot say clearly: fail with a message that says what to do. */}}
{{- define "jobrunner.validate" -}}
{{- if and .Values.watch.clusterWide .Values.watch.namespaces -}}
{{- fail "watch.clusterWide and watch.namespaces are exclusive: set one of them" -}}
{{- end -}}
{{- if and .Values.watch.clusterWide .Values.worker.serviceAccount.create -}}
{{- fail "worker.serviceAccount.create needs a namespace list (the ServiceAccount must exist in every namespace with BatchRuns): with watch.clusterWide create it yourself and set worker.serviceAccount.name" -}}
{{- end -}}
{{- end -}}
