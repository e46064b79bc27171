{{/*
Names and labels. With the release named "resilienced" (the documented command) every object is
named "resilienced", as in deploy/kubernetes/base; another release name that contains
"resilienced" is used as is, any other gets "<release>-resilienced".
*/}}
{{- define "resilienced.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "resilienced.fullname" -}}
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

{{- define "resilienced.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "resilienced.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name: the name of your ServiceAccount (serviceAccount.create is false)" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The namespace of the claims (Leases): claimsNamespace, else the release's. */}}
{{- define "resilienced.claimsNamespace" -}}
{{- default .Release.Namespace .Values.claimsNamespace }}
{{- end }}

{{/* Labels of every object: the base's two, and Helm's. */}}
{{- define "resilienced.labels" -}}
app.kubernetes.io/name: {{ include "resilienced.name" . }}
app.kubernetes.io/part-of: resilienced
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* What selects the daemon's pods (Deployment, PDB, Service, ServiceMonitor, spread). */}}
{{- define "resilienced.selectorLabels" -}}
app.kubernetes.io/name: {{ include "resilienced.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: daemon
{{- end }}

{{- define "resilienced.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* Where the notify Secret is mounted, and the file the daemon reads. */}}
{{- define "resilienced.notifyDir" -}}/etc/resilienced/notify{{- end }}
{{- define "resilienced.notifyFile" -}}/etc/resilienced/notify/webhook-url{{- end }}

{{/*
The daemon's settings (the ConfigMap's data), RESILIENCED_* only: what the values above set, then
config. A key both set is refused: one value, one place.
*/}}
{{- define "resilienced.config" -}}
{{- $v := .Values }}
{{- $c := dict "RESILIENCED_MODE" $v.mode "RESILIENCED_EXPORT_MODE" $v.checkpoint.exportMode }}
{{- $_ := set $c "RESILIENCED_CONCURRENCY" (toString $v.concurrency) }}
{{- $_ := set $c "RESILIENCED_VISIBILITY_TIMEOUT" (toString $v.visibilityTimeout) }}
{{- $_ := set $c "RESILIENCED_SHUTDOWN_TIMEOUT" (toString $v.shutdownTimeout) }}
{{- $_ := set $c "RESILIENCED_HTTP_PORT" (toString $v.httpPort) }}
{{- $_ := set $c "RESILIENCED_LOG_LEVEL" $v.logLevel }}
{{- $_ := set $c "RESILIENCED_NOTIFY_WEBHOOK_FILE" (include "resilienced.notifyFile" .) }}
{{- with $v.queueUrl }}{{ $_ := set $c "RESILIENCED_QUEUE_URL" . }}{{ end }}
{{- with $v.region }}{{ $_ := set $c "RESILIENCED_REGION" . }}{{ end }}
{{- with $v.allowedAccounts }}{{ $_ := set $c "RESILIENCED_ALLOWED_ACCOUNTS" (join "," .) }}{{ end }}
{{- with $v.allowedRegions }}{{ $_ := set $c "RESILIENCED_ALLOWED_REGIONS" (join "," .) }}{{ end }}
{{- with $v.claimsNamespace }}{{ $_ := set $c "RESILIENCED_CLAIMS_NAMESPACE" . }}{{ end }}
{{- with $v.checkpoint.fsxFileSystemId }}{{ $_ := set $c "RESILIENCED_FSX_FILE_SYSTEM_ID" . }}{{ end }}
{{- with $v.checkpoint.fsxFileSystemPath }}{{ $_ := set $c "RESILIENCED_FSX_FILE_SYSTEM_PATH" . }}{{ end }}
{{- with $v.checkpoint.fsxDataRepositoryPath }}{{ $_ := set $c "RESILIENCED_FSX_DATA_REPOSITORY_PATH" . }}{{ end }}
{{- if not (kindIs "invalid" $v.checkpoint.durableGraceSeconds) }}{{ $_ := set $c "RESILIENCED_DURABLE_GRACE_SECONDS" (toString $v.checkpoint.durableGraceSeconds) }}{{ end }}
{{- if not (kindIs "invalid" $v.checkpoint.durablePollSeconds) }}{{ $_ := set $c "RESILIENCED_DURABLE_POLL_SECONDS" (toString $v.checkpoint.durablePollSeconds) }}{{ end }}
{{- if not (kindIs "invalid" $v.checkpoint.checkpointAheadSeconds) }}{{ $_ := set $c "RESILIENCED_CHECKPOINT_AHEAD_SECONDS" (toString $v.checkpoint.checkpointAheadSeconds) }}{{ end }}
{{- with $v.checkpoint.uri }}{{ $_ := set $c "RESILIENCED_CHECKPOINT_URI" . }}{{ end }}
{{- if eq $v.mode "ray" }}
{{- $_ := set $c "RESILIENCED_RAY_ADDRESS" (required "ray.address: the Ray cluster's GCS address (HOST:6379) is required with mode: ray" $v.ray.address) }}
{{- end }}
{{- if eq $v.checkpoint.exportMode "task" }}
{{- $_ := required "checkpoint.fsxFileSystemId: required with checkpoint.exportMode: task" $v.checkpoint.fsxFileSystemId }}
{{- $_ := required "checkpoint.fsxDataRepositoryPath: required with checkpoint.exportMode: task (s3://bucket/prefix)" $v.checkpoint.fsxDataRepositoryPath }}
{{- end }}
{{- range $key, $value := $v.config }}
{{- if hasKey $c $key }}
{{- fail (printf "config.%s: set by the chart's own value (mode, queueUrl, region, checkpoint.*, ...); set that value instead" $key) }}
{{- end }}
{{- $_ := set $c $key (toString $value) }}
{{- end }}
{{- toYaml $c }}
{{- end }}
