{{/* The chart name, overridable. */}}
{{- define "disagg.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every object name: "<release>-<chart>", or the release name alone when it already holds the chart
name. Truncated to 63 characters because some fields (Service names) are DNS labels.
*/}}
{{- define "disagg.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<chart>-<version>" for the helm.sh/chart label ("+" is not allowed in label values). */}}
{{- define "disagg.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The labels a selector uses: stable across upgrades, so never the version. */}}
{{- define "disagg.selectorLabels" -}}
app.kubernetes.io/name: {{ include "disagg.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The standard labels of every object. Call with (dict "root" $ "component" "operator").
*/}}
{{- define "disagg.labels" -}}
helm.sh/chart: {{ include "disagg.chart" .root }}
{{ include "disagg.selectorLabels" .root }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/part-of: disagg
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{/* The operator pod's selector: the selector labels plus the component. */}}
{{- define "disagg.operatorSelectorLabels" -}}
{{ include "disagg.selectorLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "disagg.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "disagg.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The ClusterRole the operator binds to each DisaggDeployment's sidecars (it is told the name through
DISAGG_WORKER_CLUSTERROLE). With rbac.create=false a ClusterRole of this name must exist.
*/}}
{{- define "disagg.workerClusterRoleName" -}}
{{- printf "%s-worker" (include "disagg.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "disagg.webhookServiceName" -}}
{{- printf "%s-webhook" (include "disagg.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "disagg.webhookSecretName" -}}
{{- printf "%s-webhook-tls" (include "disagg.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The path kopf serves the validating handler on: kopf routes POST /<handler id>, so this must equal the id of the
operator's @kopf.on.validate handler for DisaggDeployments.
*/}}
{{- define "disagg.webhookPath" -}}
/validate-disaggdeployment
{{- end }}

{{- define "disagg.image" -}}
{{- printf "%s:%s" .repository (default .appVersion .tag) }}
{{- end }}

{{/*
The relabelings both monitors add: component (prefill, decode or router) and deployment (the DisaggDeployment),
from the pod labels the operator sets. Not "role": the router's own metrics have a role label.
*/}}
{{- define "disagg.monitorRelabelings" -}}
- sourceLabels: [__meta_kubernetes_pod_label_app_kubernetes_io_component]
  targetLabel: component
- sourceLabels: [__meta_kubernetes_pod_label_disagg_io_deployment]
  targetLabel: deployment
{{- end }}

{{/* Which namespaces the monitors look in: watchNamespaces, or every namespace. */}}
{{- define "disagg.monitorNamespaces" -}}
{{- if .Values.watchNamespaces }}
matchNames:
{{- range .Values.watchNamespaces }}
  - {{ . | quote }}
{{- end }}
{{- else }}
any: true
{{- end }}
{{- end }}

{{/* The workloads' pods and Services: the operator's children of these components. */}}
{{- define "disagg.monitorSelector" -}}
matchLabels:
  app.kubernetes.io/part-of: disagg
matchExpressions:
  - key: app.kubernetes.io/component
    operator: In
    values: ["prefill", "decode", "router"]
{{- end }}
