{{/* The chart name, or nameOverride: the app.kubernetes.io/name label. */}}
{{- define "proxy-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The name every object is named after: the release name, plus the chart name unless the release
name already contains it (release "proxy-operator" gives "proxy-operator", as in manifests/).
*/}}
{{- define "proxy-operator.fullname" -}}
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

{{- define "proxy-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "proxy-operator.labels" -}}
helm.sh/chart: {{ include "proxy-operator.chart" . }}
{{ include "proxy-operator.selectorLabels" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The Pod's labels, which the Deployment and the Service select on. */}}
{{- define "proxy-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "proxy-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "proxy-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "proxy-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name must name an existing ServiceAccount when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Secret holding the API tokens: the user's, or the one the chart generates. */}}
{{- define "proxy-operator.apiTokenSecret" -}}
{{- .Values.apiToken.existingSecret | default (printf "%s-api" (include "proxy-operator.fullname" .)) }}
{{- end }}

{{/*
--ledger-max-size: ledger.maxSize, else half of ledger.size in MiB (values.schema.json holds
ledger.size to a whole number of Mi, Gi or Ti), as manifests/deployment.yaml pairs 512MiB with
its 1Gi volume.
*/}}
{{- define "proxy-operator.ledgerMaxSize" -}}
{{- if .Values.ledger.maxSize }}
{{- .Values.ledger.maxSize }}
{{- else }}
{{- $size := .Values.ledger.size }}
{{- $number := regexFind "^[0-9]+" $size | int64 }}
{{- $mib := get (dict "Mi" 1 "Gi" 1024 "Ti" 1048576) (trimPrefix (toString $number) $size) | int64 }}
{{- printf "%dMiB" (div (mul $number $mib) 2) }}
{{- end }}
{{- end }}
