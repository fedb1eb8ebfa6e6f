{{- define "gpupool.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gpupool.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "gpupool.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "gpupool.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "gpupool.controllerUrl" -}}
http://{{ include "gpupool.fullname" . }}-controller.{{ .Release.Namespace }}.svc:{{ .Values.controller.port }}
{{- end -}}

{{- define "gpupool.k8sService" -}}
{{ include "gpupool.fullname" . }}-k8s
{{- end -}}

{{/* GPUPOOL_TOKEN of the extender (`k8s serve`): the named Secret (a scheduler token),
else the admin token. */}}
{{- define "gpupool.tokenEnv" -}}
- name: GPUPOOL_TOKEN
  valueFrom:
    secretKeyRef:
      {{- if .Values.auth.tokenSecret }}
      name: {{ .Values.auth.tokenSecret }}
      key: {{ .Values.auth.tokenKey }}
      {{- else }}
      name: {{ include "gpupool.adminTokenSecret" . }}
      key: token
      {{- end }}
{{- end -}}

{{/*
The agents' credential. With auth.joinTokenSecret: GPUPOOL_JOIN_TOKEN, a join token each
agent trades once for a token of its own node (kept in its hostPath data dir), so one shared
Secret never lets an agent act for another node. Else the admin token (trying the chart out).
*/}}
{{- define "gpupool.agentTokenEnv" -}}
{{- if .Values.auth.joinTokenSecret }}
- name: GPUPOOL_JOIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.auth.joinTokenSecret }}
      key: {{ .Values.auth.tokenKey }}
{{- else }}
- name: GPUPOOL_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "gpupool.adminTokenSecret" . }}
      key: token
{{- end }}
{{- end -}}


{{- define "gpupool.adminTokenSecret" -}}
{{ .Values.auth.adminTokenSecret | default (printf "%s-admin-token" (include "gpupool.fullname" .)) }}
{{- end -}}

{{/*
The cluster's version as major.minor.patch: kubeVersion when set, else what Helm reads from
the cluster (.Capabilities.KubeVersion; managed clusters add suffixes such as -eks-1234).
*/}}
{{- define "gpupool.kubeVersion" -}}
{{- $given := .Values.kubeVersion | default .Capabilities.KubeVersion.Version | toString -}}
{{- $found := regexFind "[0-9]+\\.[0-9]+\\.[0-9]+" $given -}}
{{- if not $found -}}
{{- fail (printf "cannot read a Kubernetes version from %q: set kubeVersion, e.g. 1.31.4" $given) -}}
{{- end -}}
{{- $found -}}
{{- end -}}

{{/* The API version of KubeSchedulerConfiguration that the cluster's scheduler serves. */}}
{{- define "gpupool.schedulerConfigApi" -}}
{{- $v := include "gpupool.kubeVersion" . -}}
{{- if semverCompare ">=1.25.0-0" $v -}}kubescheduler.config.k8s.io/v1
{{- else if semverCompare ">=1.23.0-0" $v -}}kubescheduler.config.k8s.io/v1beta3
{{- else if semverCompare ">=1.22.0-0" $v -}}kubescheduler.config.k8s.io/v1beta2
{{- else -}}kubescheduler.config.k8s.io/v1beta1
{{- end -}}
{{- end -}}

{{- define "gpupool.pdbApi" -}}
{{- if semverCompare ">=1.21.0-0" (include "gpupool.kubeVersion" .) -}}policy/v1{{- else -}}policy/v1beta1{{- end -}}
{{- end -}}

{{/* Webhooks with matchConditions (CEL): beta and on by default from 1.28. */}}
{{- define "gpupool.matchConditions" -}}
{{- if semverCompare ">=1.28.0-0" (include "gpupool.kubeVersion" .) -}}true{{- end -}}
{{- end -}}

{{- define "gpupool.schedulerImage" -}}
{{ .Values.scheduler.image.repository }}:{{ .Values.scheduler.image.tag | default (printf "v%s" (include "gpupool.kubeVersion" .)) }}
{{- end -}}

{{/* A restricted pod: not root (uid given), the runtime's default seccomp profile. */}}
{{- define "gpupool.restrictedPod" -}}
runAsNonRoot: true
runAsUser: {{ . }}
runAsGroup: {{ . }}
fsGroup: {{ . }}
seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{/* A restricted container: no privilege escalation, no capability, a read-only root. */}}
{{- define "gpupool.restrictedContainer" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: [ALL]}
{{- end -}}
