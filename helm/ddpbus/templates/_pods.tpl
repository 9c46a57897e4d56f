{{/* What every pod of the release shares, and each component's scheduling settings.
(dict "root" $ "component" "coordinator"|"worker"|"nats"|"test"): the component's values
section is .Values.<component> (the helm-test pod has none: the release-wide values only). */}}

{{- define "ddpbus.componentValues" -}}
{{- toJson (get .root.Values .component | default dict) -}}
{{- end -}}

{{/* the pod template's metadata: the labels given, the release-wide and the component's
podLabels and podAnnotations, and the annotations given (.annotations: a YAML map) */}}
{{- define "ddpbus.podMeta" -}}
{{- $v := include "ddpbus.componentValues" . | fromJson -}}
{{- $labels := merge (dict) ($v.podLabels | default dict) (.root.Values.podLabels | default dict) -}}
{{- $annotations := merge (dict) (.annotations | default "" | fromYaml) ($v.podAnnotations | default dict) (.root.Values.podAnnotations | default dict) -}}
labels:
  {{- include "ddpbus.labels" .root | nindent 2 }}
  app.kubernetes.io/component: {{ .component }}
  {{- with .labels }}
  {{- . | nindent 2 }}
  {{- end }}
  {{- with $labels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* pod-spec fields every pod sets: no service links (a Service's variables must not reach
the CLI), no API token (nothing here calls the API server), the restricted Pod Security
profile's pod context, pull secrets, and the component's scheduling settings (priority,
scheduler and runtime class default to the release-wide ones) */}}
{{- define "ddpbus.podCommon" -}}
{{- $root := .root -}}
{{- $v := include "ddpbus.componentValues" . | fromJson -}}
serviceAccountName: {{ include "ddpbus.serviceAccount" $root }}
automountServiceAccountToken: false
enableServiceLinks: false
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- with $root.Values.image.pullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with ($v.priorityClassName | default $root.Values.priorityClassName) }}
priorityClassName: {{ . }}
{{- end }}
{{- with ($v.schedulerName | default $root.Values.schedulerName) }}
schedulerName: {{ . }}
{{- end }}
{{- with ($v.runtimeClassName | default $root.Values.runtimeClassName) }}
runtimeClassName: {{ . }}
{{- end }}
{{- with $v.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if $v.affinity }}
affinity:
  {{- toYaml $v.affinity | nindent 2 }}
{{- else if and (eq .component "coordinator") (gt (int $root.Values.coordinator.replicas) 1) }}
# leader and standby apart: one node's loss must not take both
affinity:
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "ddpbus.selector" (dict "root" $root "component" "coordinator") | nindent 14 }}
{{- end }}
{{- with $v.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* a Job's failure handling (restartPolicy Never): exit 2 is a bad setting or a refused
rank and exit 4 a job that had already ended, which no retry mends (the Job fails at once,
its reason in the pod's log); a drain or a preemption (DisruptionTarget) is not the pod's
fault and costs no retry; any other failure is retried up to workload.backoffLimit times */}}
{{- define "ddpbus.jobSpec" -}}
backoffLimit: {{ .root.Values.workload.backoffLimit }}
{{- with .root.Values.workload.ttlSecondsAfterFinished }}
ttlSecondsAfterFinished: {{ . }}
{{- end }}
podFailurePolicy:
  rules:
    - action: FailJob
      onExitCodes:
        containerName: {{ .container }}
        operator: In
        values: [2, 4]
    - action: Ignore
      onPodConditions:
        - type: DisruptionTarget
          status: "True"
{{- end -}}

{{- define "ddpbus.jobMeta" -}}
labels:
  {{- include "ddpbus.labels" .root | nindent 2 }}
  app.kubernetes.io/component: {{ .component }}
  {{- with .labels }}
  {{- . | nindent 2 }}
  {{- end }}
  {{- if not .child }}{{/* a JobSet's Jobs: Kueue reads the JobSet's labels */}}
  {{- with .root.Values.workload.labels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
  {{- end }}
{{- if not .child }}
{{- with .root.Values.workload.annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- end -}}

{{/* extra volumes and mounts of a component */}}
{{- define "ddpbus.extraVolumes" -}}
{{- $v := include "ddpbus.componentValues" . | fromJson -}}
{{- with $v.extraVolumes }}
{{- toYaml . }}
{{- end }}
{{- end -}}

{{- define "ddpbus.extraVolumeMounts" -}}
{{- $v := include "ddpbus.componentValues" . | fromJson -}}
{{- with $v.extraVolumeMounts }}
{{- toYaml . }}
{{- end }}
{{- end -}}
