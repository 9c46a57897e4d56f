{{/* NATS identities, their credentials and permissions, TLS (README "Authentication and TLS") */}}

{{/* the job's identities, as a JSON list: coordinator, observer, rank-0 .. rank-<workers-1> */}}
{{- define "ddpbus.identities" -}}
{{- $ids := list "coordinator" "observer" -}}
{{- range $r := until (int .Values.training.workers) -}}
{{- $ids = append $ids (printf "rank-%d" $r) -}}
{{- end -}}
{{- toJson $ids -}}
{{- end -}}

{{/* fast death detection (coordinator.presence): "true" when the coordinator gets a login
to the server's system account, whose client advisories name a killed rank's closed
connection: the bundled server (the chart makes that account and its login), or an
existing one with coordinator.presence.existingSecret */}}
{{- define "ddpbus.presence" -}}
{{- $p := .Values.coordinator.presence -}}
{{- if and $p.enabled .Values.auth.enabled (or .Values.nats.bundled $p.existingSecret) -}}
true
{{- end -}}
{{- end -}}

{{/* the identities whose logins the bundled server holds: the job's, and "system" (the
coordinator's system-account login) with coordinator.presence */}}
{{- define "ddpbus.serverLogins" -}}
{{- $ids := include "ddpbus.identities" . | fromJsonArray -}}
{{- if include "ddpbus.presence" . -}}
{{- $ids = append $ids "system" -}}
{{- end -}}
{{- toJson $ids -}}
{{- end -}}

{{/* the Secret of the coordinator's system-account login */}}
{{- define "ddpbus.systemSecret" -}}
{{- if .Values.nats.bundled -}}
{{- include "ddpbus.identitySecret" (dict "root" . "identity" "system") -}}
{{- else -}}
{{- .Values.coordinator.presence.existingSecret -}}
{{- end -}}
{{- end -}}

{{/* the Secret of one identity: (dict "root" . "identity" "rank-0") */}}
{{/* the chart makes the logins: the bundled server, no auth.existing.secretPrefix */}}
{{- define "ddpbus.chartLogins" -}}
{{- if and .Values.nats.bundled .Values.auth.enabled (not .Values.auth.existing.secretPrefix) -}}
true
{{- end -}}
{{- end -}}

{{- define "ddpbus.identitySecret" -}}
{{- if include "ddpbus.chartLogins" .root -}}
{{- printf "%s-nats-%s" (include "ddpbus.fullname" .root) .identity -}}
{{- else -}}
{{- printf "%s-%s" (required "auth.existing.secretPrefix is required when nats.bundled is false and auth.enabled is true (or set auth.enabled=false: no credentials)" .root.Values.auth.existing.secretPrefix) .identity -}}
{{- end -}}
{{- end -}}

{{/* the bundled server's logins, as JSON {identity: {password, bcrypt}}. A password is kept
from its Secret (lookup) or made at random, and so is its bcrypt hash while it is still the
hash of that password (bcrypt salts are random: a new hash per render would rewrite the
server's config and restart NATS on every upgrade). Computed once per render and kept in
.Values, so every template sees the same random values on a first install. */}}
{{- define "ddpbus.natsUsers" -}}
{{- if not (hasKey .Values "__ddpbusNatsUsers") -}}
{{- $users := dict -}}
{{- range $id := include "ddpbus.serverLogins" $ | fromJsonArray -}}
{{- $old := lookup "v1" "Secret" $.Release.Namespace (include "ddpbus.identitySecret" (dict "root" $ "identity" $id)) -}}
{{- $data := dig "data" (dict) $old -}}
{{- $password := randAlphaNum 40 -}}
{{- if hasKey $data "password" -}}
{{- $password = index $data "password" | b64dec -}}
{{- end -}}
{{- $hash := "" -}}
{{- if and (hasKey $data "bcrypt") (eq (index $data "password.sha256" | default "" | b64dec) (sha256sum $password)) -}}
{{- $hash = index $data "bcrypt" | b64dec -}}
{{- else -}}
{{- $hash = bcrypt $password -}}
{{- end -}}
{{- $_ := set $users $id (dict "password" $password "bcrypt" $hash) -}}
{{- end -}}
{{- $_ := set .Values "__ddpbusNatsUsers" $users -}}
{{- end -}}
{{- toJson (index .Values "__ddpbusNatsUsers") -}}
{{- end -}}

{{/* training.resume when it names an earlier job (not a bundle directory), else "" */}}
{{- define "ddpbus.resumeJob" -}}
{{- if regexMatch "^[A-Za-z0-9_-]{1,64}$" .Values.training.resume -}}
{{- .Values.training.resume -}}
{{- end -}}
{{- end -}}

{{/* the nats-server permissions of one identity, as JSON: (dict "root" . "identity" ID).
files/permissions.json is ddpbus.orchestrator.transport.auth.chart_permissions() (a chart test keeps
them equal), placeholders filled in here; training.resume adds read access to that job. */}}
{{- define "ddpbus.permissions" -}}
{{- $role := .identity -}}
{{- $rank := "" -}}
{{- if hasPrefix "rank-" .identity -}}
{{- $role = "rank" -}}
{{- $rank = trimPrefix "rank-" .identity -}}
{{- end -}}
{{- $resume := include "ddpbus.resumeJob" .root -}}
{{- $all := .root.Files.Get "files/permissions.json" | fromJson -}}
{{- $raw := index $all $role -}}
{{- $job := include "ddpbus.job" .root -}}
{{- $p := $raw | toRawJson | replace "@JOB@" $job | replace "@RANK@" $rank | replace "@RESUME@" $resume | fromJson -}}
{{- $pub := $p.publish -}}
{{- $sub := $p.subscribe -}}
{{- if $resume -}}
{{- $pub = concat $pub $p.resume.publish | uniq -}}
{{- $sub = concat $sub $p.resume.subscribe | uniq -}}
{{- end -}}
{{- $publish := dict "allow" $pub -}}
{{- if hasKey $raw "publishDeny" -}}
{{- /* the observer: never the job's durables (the coordinator's, each rank's) */ -}}
{{- $deny := $p.publishDeny -}}
{{- range $r := until (int .root.Values.training.workers) -}}
{{- $deny = concat $deny ($raw.publishDenyPerRank | toRawJson | replace "@JOB@" $job | replace "@RANK@" (toString $r) | fromJsonArray) -}}
{{- end -}}
{{- $_ := set $publish "deny" $deny -}}
{{- end -}}
{{- toRawJson (dict "publish" $publish "subscribe" (dict "allow" $sub)) -}}
{{- end -}}

{{/* the bundled server's authorization block: one user per identity, no anonymous login
(the nats-server config format takes JSON values) */}}
{{- define "ddpbus.natsAuthConfig" -}}
{{- if include "ddpbus.chartLogins" . }}
{{- $users := include "ddpbus.natsUsers" . | fromJson -}}
{{- $list := list -}}
{{- range $id := include "ddpbus.identities" . | fromJsonArray -}}
{{- $perms := include "ddpbus.permissions" (dict "root" $ "identity" $id) | fromJson -}}
{{- $list = append $list (dict "user" $id "password" (index $users $id).bcrypt "permissions" $perms) -}}
{{- end -}}
# one user per identity of job {{ include "ddpbus.job" . }}; passwords are bcrypt hashes
authorization {{ toRawJson (dict "users" $list) }}
{{- if include "ddpbus.presence" . }}
# the system account: its one user, the coordinator's, reads the client advisories
accounts {{ toRawJson (dict "SYS" (dict "users" (list (dict "user" "system" "password" (index $users "system").bcrypt)))) }}
system_account: SYS
{{- end }}
{{- else }}
# one user per identity of job {{ include "ddpbus.job" . }}, each login read from its
# Secret <auth.existing.secretPrefix>-<identity> (the server's environment: ddpbus.loginEnv)
authorization {
  users: [
{{- range $id := include "ddpbus.identities" . | fromJsonArray }}
{{- $var := include "ddpbus.loginVar" $id }}
    {user: ${{ $var }}_USER, password: ${{ $var }}_PASSWORD, permissions: {{ include "ddpbus.permissions" (dict "root" $ "identity" $id) }}}
{{- end }}
  ]
}
{{- if include "ddpbus.presence" . }}
# the system account: its one user, the coordinator's, reads the client advisories
accounts {
  SYS: {users: [{user: $LOGIN_SYSTEM_USER, password: $LOGIN_SYSTEM_PASSWORD}]}
}
system_account: SYS
{{- end }}
{{- end }}
{{- end -}}

{{/* the server's environment variable of one identity's login: LOGIN_RANK_0 (_USER, _PASSWORD) */}}
{{- define "ddpbus.loginVar" -}}
{{- printf "LOGIN_%s" (. | upper | replace "-" "_") -}}
{{- end -}}

{{/* the bundled server's environment with existing logins: each identity's user and
password from its Secret (the config refers to them: ddpbus.natsAuthConfig) */}}
{{- define "ddpbus.loginEnv" -}}
{{- if and .Values.auth.enabled (not (include "ddpbus.chartLogins" .)) }}
{{- range $id := include "ddpbus.serverLogins" . | fromJsonArray }}
{{- $var := include "ddpbus.loginVar" $id }}
{{- range $key := list "user" "password" }}
- name: {{ $var }}_{{ $key | upper }}
  valueFrom:
    secretKeyRef:
      name: {{ include "ddpbus.identitySecret" (dict "root" $ "identity" $id) }}
      key: {{ $key }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* the bundled server's config */}}
{{- define "ddpbus.natsConfig" -}}
port: 4222
http_port: 8222
max_payload: {{ .Values.nats.maxPayload }}
pid_file: /var/run/nats/nats.pid
lame_duck_duration: {{ .Values.nats.lameDuckDuration }}
lame_duck_grace_period: {{ .Values.nats.lameDuckGracePeriod }}
jetstream {
  store_dir: /data/jetstream
}
{{- if .Values.nats.tls.enabled }}
{{- $tls := dict "cert_file" "/etc/nats-tls/tls.crt" "key_file" "/etc/nats-tls/tls.key" }}
{{- if .Values.nats.tls.verifyClients }}
{{- $tls = merge $tls (dict "ca_file" "/etc/nats-tls/ca.crt" "verify" true) }}
{{- end }}
tls {{ toRawJson $tls }}
{{- end }}
{{- if .Values.auth.enabled }}
include auth.conf
{{- end }}
{{- end -}}

{{/* the key of an identity's Secret that its pod mounts, and the file it becomes */}}
{{- define "ddpbus.credentialKey" -}}
{{- if include "ddpbus.chartLogins" . -}}
password
{{- else -}}
{{- get (dict "password" "password" "creds" "creds" "nkey" "seed") .Values.auth.existing.kind -}}
{{- end -}}
{{- end -}}

{{/* a client's NATS login and TLS settings: (dict "root" . "identity" ID) */}}
{{- define "ddpbus.natsAuthEnv" -}}
{{- $v := .root.Values -}}
{{- if $v.auth.enabled }}
{{- $key := include "ddpbus.credentialKey" .root }}
{{- if eq $key "password" }}
- name: DDPBUS_NATS_USER
{{- if include "ddpbus.chartLogins" .root }}
  value: {{ .identity | quote }}
{{- else }}
  valueFrom:
    secretKeyRef:
      name: {{ include "ddpbus.identitySecret" . }}
      key: user
{{- end }}
- name: DDPBUS_NATS_PASSWORD_FILE
  value: /etc/ddpbus/nats/password
{{- else if eq $key "creds" }}
- name: DDPBUS_NATS_CREDS
  value: /etc/ddpbus/nats/creds
{{- else }}
- name: DDPBUS_NATS_NKEY
  value: /etc/ddpbus/nats/seed
{{- end }}
{{- end }}
{{- if $v.nats.tls.enabled }}
- name: DDPBUS_NATS_TLS_CA
  value: /etc/ddpbus/nats/ca.crt
{{- if $v.nats.tls.verifyClients }}
- name: DDPBUS_NATS_TLS_CERT
  value: /etc/ddpbus/nats/tls.crt
- name: DDPBUS_NATS_TLS_KEY
  value: /etc/ddpbus/nats/tls.key
{{- end }}
{{- end }}
{{- end -}}

{{- define "ddpbus.natsAuthMounts" -}}
{{- if or .Values.auth.enabled .Values.nats.tls.enabled }}
- name: nats-auth
  mountPath: /etc/ddpbus/nats
  readOnly: true
{{- end }}
{{- end -}}

{{/* one projected volume: this identity's credential, the CA, the client certificate */}}
{{- define "ddpbus.natsAuthVolumes" -}}
{{- $v := .root.Values -}}
{{- if or $v.auth.enabled $v.nats.tls.enabled }}
- name: nats-auth
  projected:
    defaultMode: 0400
    sources:
      {{- if $v.auth.enabled }}
      {{- $key := include "ddpbus.credentialKey" .root }}
      - secret:
          name: {{ include "ddpbus.identitySecret" . }}
          items: [{key: {{ $key }}, path: {{ $key }}}]
      {{- end }}
      {{- if $v.nats.tls.enabled }}
      - secret:
          name: {{ include "ddpbus.tlsSecret" .root }}
          items: [{key: ca.crt, path: ca.crt}]
      {{- if $v.nats.tls.verifyClients }}
      - secret:
          name: {{ $v.nats.tls.clientSecretName | default $v.nats.tls.secretName }}
          items: [{key: tls.crt, path: tls.crt}, {key: tls.key, path: tls.key}]
      {{- end }}
      {{- end }}
{{- end }}
{{- end -}}

{{- define "ddpbus.tlsSecret" -}}
{{- required "nats.tls.secretName is required when nats.tls.enabled is true (a kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt)" .Values.nats.tls.secretName -}}
{{- end -}}

{{/* a pod annotation that changes when the identity's password does (a rolled pod reads
the new one); bundled server only: an existing server's Secrets are the user's */}}
{{- define "ddpbus.loginChecksum" -}}
{{- if include "ddpbus.chartLogins" .root -}}
ddpbus.io/nats-login: {{ (index (include "ddpbus.natsUsers" .root | fromJson) .identity).bcrypt | sha256sum | trunc 16 | quote }}
{{- end -}}
{{- end -}}

{{- define "ddpbus.checkAuthValues" -}}
{{- if and .Values.nats.tls.verifyClients (not .Values.nats.tls.enabled) -}}
{{- fail "nats.tls.verifyClients needs nats.tls.enabled" -}}
{{- end -}}
{{- if and .Values.nats.tls.clientSecretName (not .Values.nats.tls.verifyClients) -}}
{{- fail "nats.tls.clientSecretName is for mutual TLS: set nats.tls.verifyClients" -}}
{{- end -}}
{{- if and .Values.nats.bundled .Values.auth.existing.secretPrefix (ne .Values.auth.existing.kind "password") -}}
{{- fail "the bundled server takes existing logins of kind password (keys user and password): auth.existing.kind=password" -}}
{{- end -}}
{{- end -}}

{{/* the coordinator's system-account login (coordinator.presence): its environment */}}
{{- define "ddpbus.systemLoginEnv" -}}
{{- if include "ddpbus.presence" . }}
{{- $key := include "ddpbus.credentialKey" . }}
{{- if eq $key "password" }}
- name: DDPBUS_NATS_SYSTEM_USER
{{- if include "ddpbus.chartLogins" . }}
  value: system
{{- else }}
  valueFrom:
    secretKeyRef:
      name: {{ include "ddpbus.systemSecret" . }}
      key: user
{{- end }}
- name: DDPBUS_NATS_SYSTEM_PASSWORD_FILE
  value: /etc/ddpbus/nats-system/password
{{- else if eq $key "creds" }}
- name: DDPBUS_NATS_SYSTEM_CREDS
  value: /etc/ddpbus/nats-system/creds
{{- else }}
- name: DDPBUS_NATS_SYSTEM_NKEY
  value: /etc/ddpbus/nats-system/seed
{{- end }}
{{- end }}
{{- end -}}

{{- define "ddpbus.systemLoginMounts" -}}
{{- if include "ddpbus.presence" . }}
- name: nats-system
  mountPath: /etc/ddpbus/nats-system
  readOnly: true
{{- end }}
{{- end -}}

{{- define "ddpbus.systemLoginVolumes" -}}
{{- if include "ddpbus.presence" . }}
{{- $key := include "ddpbus.credentialKey" . }}
- name: nats-system
  projected:
    defaultMode: 0400
    sources:
      - secret:
          name: {{ include "ddpbus.systemSecret" . }}
          items: [{key: {{ $key }}, path: {{ $key }}}]
{{- end }}
{{- end -}}
