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
      name: {{ include "gpupool.fullname" . }}-admin-token
      key: token
      {{- end }}
{{- end -}}

{{/*
The TLS certificates of the extender and webhook: the server's (the given Secret, else one
generated with a CA of its own) and the scheduler's client certificate, signed by the same
CA. Reused from the cluster on upgrades so the webhook's caBundle stays valid; made again
(all together) where an older release left no client certificate. Returns a dict with crt,
key, ca, schedulerCrt and schedulerKey (all base64).
*/}}
{{- define "gpupool.tls" -}}
{{- $service := include "gpupool.k8sService" . -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (printf "%s-tls" $service) -}}
{{- $client := lookup "v1" "Secret" .Release.Namespace (printf "%s-scheduler-client" $service) -}}
{{- if and $existing $existing.data (index $existing.data "ca.crt") $client $client.data (index $client.data "tls.crt") -}}
{{- dict "crt" (index $existing.data "tls.crt") "key" (index $existing.data "tls.key") "ca" (index $existing.data "ca.crt") "schedulerCrt" (index $client.data "tls.crt") "schedulerKey" (index $client.data "tls.key") | toJson -}}
{{- else -}}
{{- $dns := list $service (printf "%s.%s" $service .Release.Namespace) (printf "%s.%s.svc" $service .Release.Namespace) -}}
{{- $ca := genCA "gpupool-k8s-ca" 3650 -}}
{{- $cert := genSignedCert (printf "%s.%s.svc" $service .Release.Namespace) nil $dns 3650 $ca -}}
{{- $scheduler := genSignedCert .Values.k8s.auth.schedulerClientName nil nil 3650 $ca -}}
{{- dict "crt" ($cert.Cert | b64enc) "key" ($cert.Key | b64enc) "ca" ($ca.Cert | b64enc) "schedulerCrt" ($scheduler.Cert | b64enc) "schedulerKey" ($scheduler.Key | b64enc) | toJson -}}
{{- end -}}
{{- end -}}

{{/*
The bearer token kube-apiserver sends to the webhook (k8s.auth.webhookToken): made once,
kept across upgrades.
*/}}
{{- define "gpupool.webhookToken" -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (printf "%s-webhook-token" (include "gpupool.k8sService" .)) -}}
{{- if and $existing $existing.data (index $existing.data "token") -}}
{{- index $existing.data "token" | b64dec -}}
{{- else -}}
{{- randAlphaNum 48 -}}
{{- end -}}
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
      name: {{ include "gpupool.fullname" . }}-admin-token
      key: token
{{- end }}
{{- end -}}
