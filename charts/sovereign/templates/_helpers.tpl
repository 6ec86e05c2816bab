{{/* Names and labels shared by every template. */}}
{{- define "sovereign.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sovereign.fullname" -}}
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

{{- define "sovereign.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "sovereign.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sovereign
{{- end -}}

{{- define "sovereign.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sovereign.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "sovereign.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "sovereign.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* repository:tag, or repository@digest when a digest is pinned. */}}
{{- define "sovereign.operatorImage" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "sovereign.runtimeImage" -}}
{{- printf "%s:%s" .Values.runtimeImage.repository (default .Chart.AppVersion .Values.runtimeImage.tag) -}}
{{- end -}}

{{/* Non-empty when operator.watchNamespaces names namespaces (the schema admits names only): the
     operator's rules are then bound in those namespaces only. */}}
{{- define "sovereign.namespacedRBAC" -}}
{{- if .Values.operator.watchNamespaces -}}true{{- end -}}
{{- end -}}
