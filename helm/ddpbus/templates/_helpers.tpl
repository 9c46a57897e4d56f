{{/* names and labels */}}
{{- define "ddpbus.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{- define "ddpbus.job" -}}
{{- .Values.job | default (.Release.Name | replace "." "-") | trunc 64 -}}
{{- end -}}

{{- define "ddpbus.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
ddpbus.io/job: {{ include "ddpbus.job" . }}
{{- end -}}

{{- define "ddpbus.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "ddpbus.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "ddpbus.serviceAccount" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "ddpbus.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{- define "ddpbus.natsUrl" -}}
{{- if .Values.nats.bundled -}}
{{- printf "nats://%s-nats:4222" (include "ddpbus.fullname" .) -}}
{{- else -}}
{{- required "nats.url or nats.urlSecret.name is required when nats.bundled is false" .Values.nats.url -}}
{{- end -}}
{{- end -}}

{{/* DDPBUS_NATS_URL: from the Secret (credentials inside) or in clear */}}
{{- define "ddpbus.natsUrlEnv" -}}
- name: DDPBUS_NATS_URL
{{- if and (not .Values.nats.bundled) .Values.nats.urlSecret.name }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.nats.urlSecret.name }}
      key: {{ .Values.nats.urlSecret.key }}
{{- else }}
  value: {{ include "ddpbus.natsUrl" . | quote }}
{{- end }}
{{- end -}}

{{- define "ddpbus.keySecret" -}}
{{- .Values.jobKey.existingSecret | default (printf "%s-job-key" (include "ddpbus.fullname" .)) -}}
{{- end -}}

{{- define "ddpbus.specRef" -}}
{{- $s := .Values.spec -}}
{{- if $s.module -}}
{{- $s.module -}}
{{- else if or $s.configMap.name $s.inline -}}
{{- printf "/etc/ddpbus/spec/%s:spec" ($s.configMap.key | default "spec.py") -}}
{{- else -}}
/opt/ddpbus/examples/digits.py:spec
{{- end -}}
{{- end -}}

{{- define "ddpbus.specConfigMap" -}}
{{- .Values.spec.configMap.name | default (printf "%s-spec" (include "ddpbus.fullname" .)) -}}
{{- end -}}

{{/* environment every ddpbus container shares */}}
{{- define "ddpbus.commonEnv" -}}
- name: HOME  # the root filesystem is read-only: caches (torch, matplotlib) go to /tmp
  value: /tmp
- name: DDPBUS_JOB
  value: {{ include "ddpbus.job" . | quote }}
{{ include "ddpbus.natsUrlEnv" . }}
- name: DDPBUS_KEY_FILE
  value: /etc/ddpbus/key/{{ .Values.jobKey.secretKey }}
- name: DDPBUS_WORLD_SIZE
  value: {{ .Values.training.workers | quote }}
- name: DDPBUS_SPEC
  value: {{ include "ddpbus.specRef" . | quote }}
{{- end -}}

{{- define "ddpbus.commonMounts" -}}
- name: job-key
  mountPath: /etc/ddpbus/key
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if or .Values.spec.configMap.name .Values.spec.inline }}
- name: spec
  mountPath: /etc/ddpbus/spec
  readOnly: true
{{- end }}
{{- end -}}

{{- define "ddpbus.commonVolumes" -}}
- name: job-key
  secret:
    secretName: {{ include "ddpbus.keySecret" . }}
    defaultMode: 0400
- name: tmp
  emptyDir: {}
{{- if or .Values.spec.configMap.name .Values.spec.inline }}
- name: spec
  configMap:
    name: {{ include "ddpbus.specConfigMap" . }}
{{- end }}
{{- end -}}

{{- define "ddpbus.trainingArgs" -}}
{{- if .Values.training.wireJson }}
- --wire-json
{{- end }}
- --policy={{ .Values.training.policy }}
- --backend={{ .Values.training.backend }}
{{- with .Values.training.epochs }}
- --epochs={{ . }}
{{- end }}
{{- with .Values.training.batchSize }}
- --batch-size={{ . }}
{{- end }}
{{- range $k, $v := .Values.training.knobs }}
- --knob={{ $k }}={{ $v }}
{{- end }}
{{- end -}}

{{/* rank N's StatefulSet: <fullname>-worker-N, short enough for the controller-revision-hash
label (a StatefulSet's name plus 11 characters must fit in 63) */}}
{{- define "ddpbus.workerName" -}}
{{- printf "%s-worker-%d" (include "ddpbus.fullname" .root | trunc 40 | trimSuffix "-") (int .rank) -}}
{{- end -}}

{{/* the bundled NATS image: by digest when one is given (repository@sha256:...), else the
tag, pinned to the server version ddpbus is tested against */}}
{{- define "ddpbus.natsImage" -}}
{{- $i := .Values.nats.image -}}
{{- if $i.digest -}}
{{- printf "%s@%s" $i.repository $i.digest -}}
{{- else -}}
{{- printf "%s:%s" $i.repository $i.tag -}}
{{- end -}}
{{- end -}}

{{/* 90 % of nats.resources.limits.memory in bytes (Ki, Mi, Gi, Ti, K, M, G, T or bytes);
empty without a memory limit */}}
{{- define "ddpbus.goMemLimit" -}}
{{- $limit := dig "limits" "memory" "" .Values.nats.resources | toString -}}
{{- if $limit -}}
{{- $units := dict "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "K" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "" 1 -}}
{{- $number := regexFind "^[0-9]+" $limit -}}
{{- $unit := trimPrefix $number $limit -}}
{{- if or (not $number) (not (hasKey $units $unit)) -}}
{{- fail (printf "nats.resources.limits.memory %q: use a whole number with Ki, Mi, Gi, Ti, K, M, G or T" $limit) -}}
{{- end -}}
{{- div (mul (int64 $number) (index $units $unit) 9) 10 -}}
{{- end -}}
{{- end -}}
