{{/* Names, labels and the numbers the RayCluster and the ConfigMap must agree on. */}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The RayCluster / Service / ConfigMap name. KubeRay derives pod and service names from
the RayCluster name, so keep it short: 63 characters at most. */}}
{{- define "pdserve.fullname" -}}
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

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" . }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels KubeRay itself puts on the head pod (ray.io/cluster = the RayCluster name,
ray.io/node-type = head); the router Service selects on them. They are written into the
pod template too, so the rendered chart shows what the Service will match. */}}
{{- define "pdserve.headPodLabels" -}}
ray.io/cluster: {{ include "pdserve.fullname" . }}
ray.io/node-type: head
{{- end }}

{{- define "pdserve.image" -}}
{{ printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{- define "pdserve.secretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-auth" (include "pdserve.fullname" .)) }}
{{- end }}

{{/* The Secret holding Ray's auth token (data key auth_token), used in token mode. */}}
{{- define "pdserve.rayAuthSecretName" -}}
{{- .Values.rayAuth.existingSecret | default (printf "%s-ray-token" (include "pdserve.fullname" .)) }}
{{- end }}

{{/* Ray auth env of every Ray container and of the router (a list of EnvVar). KubeRay
injects the same pair into the Ray container only (and skips a name already set), so the
router, a second container of the head pod, needs it from the chart; setting it on every
container keeps all of them on one mode and one token. */}}
{{- define "pdserve.rayAuthEnv" -}}
- name: RAY_AUTH_MODE
  value: {{ .Values.rayAuth.mode | quote }}
{{- if eq .Values.rayAuth.mode "token" }}
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ include "pdserve.rayAuthSecretName" . }}, key: auth_token}
{{- end }}
{{- end }}

{{/* 1 when prefill and decode pods have no GPUs (validated: both or neither). */}}
{{- define "pdserve.cpuOnly" -}}
{{- if and (eq (int .Values.prefill.gpusPerPod) 0) (eq (int .Values.decode.gpusPerPod) 0) }}1{{ end }}
{{- end }}

{{/* pdserve workers per pod of a group (argument: the group's values): one per GPU, or one
per pod on a CPU-only install. This is also the pod's pdserve_<role> Ray resource. */}}
{{- define "pdserve.workersPerPod" -}}
{{- max 1 (int .gpusPerPod) }}
{{- end }}

{{/* Workers pdserve starts with: replicas x workers per pod; 0 prefill in colocated mode
(the group is validated to have 0 replicas then). */}}
{{- define "pdserve.initialWorkers" -}}
{{- $g := index .Values .role }}
{{- mul (int $g.replicas) (int (include "pdserve.workersPerPod" $g)) }}
{{- end }}

{{/* Autoscaling bound (dict: root, role, bound "min"|"max"): the value, or the group's
min/maxReplicas x workers per pod when null. */}}
{{- define "pdserve.workerBound" -}}
{{- $g := index .root.Values .role }}
{{- $v := index (index .root.Values.autoscaling .role) (printf "%sWorkers" .bound) }}
{{- if kindIs "invalid" $v }}
{{- mul (int (index $g (printf "%sReplicas" .bound))) (int (include "pdserve.workersPerPod" $g)) }}
{{- else }}
{{- int $v }}
{{- end }}
{{- end }}

{{/* The `resources` rayStartParam of a pool pod: JSON wrapped in single quotes. KubeRay
pastes rayStartParams unquoted into a shell line (`ray start --resources=VALUE`), so the
quotes keep the JSON one word, and Ray's KubeRay autoscaler reads the value by dropping
its first and last character (autoscaling_config._get_custom_resources). */}}
{{- define "pdserve.rayResources" -}}
{{- printf "'%s'" (dict .name (int .count) | toJson) }}
{{- end }}

{{/* rayStartParams of a group: the user's extras (as strings) under the chart's own. */}}
{{- define "pdserve.rayStartParams" -}}
{{- $params := merge (deepCopy .own) (.extra | default dict) }}
{{- range $k, $v := $params }}
{{ $k }}: {{ $v | toString | quote }}
{{- end }}
{{- end }}

{{/* The cache volume (values `cache`) of prefill and decode pods: mounted at
/var/cache/pdserve, and the env that points Triton, Hugging Face and pdserve at it. Empty
with cache.type none. */}}
{{- define "pdserve.cacheOn" -}}
{{- if ne .Values.cache.type "none" }}1{{ end }}
{{- end }}

{{- define "pdserve.cacheEnv" -}}
- name: TRITON_CACHE_DIR
  value: /var/cache/pdserve/triton
- name: HF_HOME
  value: /var/cache/pdserve/huggingface
- name: PDSERVE_CACHE_DIR
  value: /var/cache/pdserve/pdserve
{{- end }}

{{- define "pdserve.cacheVolume" -}}
{{- $c := .Values.cache }}
- name: pdserve-cache
{{- if eq $c.type "emptyDir" }}
  emptyDir: {}
{{- else if eq $c.type "hostPath" }}
  hostPath: {path: {{ $c.hostPath | quote }}, type: DirectoryOrCreate}
{{- else }}
  persistentVolumeClaim: {claimName: {{ $c.existingClaim | quote }}}
{{- end }}
{{- end }}

{{/* How long the router may take to stop, in whole seconds: serve.shutdown_timeout_s
(vLLM's --shutdown-timeout, 10 by default) for the running requests, 5 s in which it
answers what is left with a 503 (cluster/shutdown.py), and up to 30 s to stop the workers
through Ray. The pods' preStop hooks wait this long at most. */}}
{{- define "pdserve.routerStopSeconds" -}}
{{- $t := 10 }}
{{- if hasKey .Values.serve "shutdown_timeout_s" }}
{{- $t = .Values.serve.shutdown_timeout_s }}
{{- end }}
{{- add (int (ceil $t)) 35 }}
{{- end }}

{{/* terminationGracePeriodSeconds of every pod: the router's stop, then `ray stop`. */}}
{{- define "pdserve.terminationGraceSeconds" -}}
{{- add (int (include "pdserve.routerStopSeconds" .)) 15 }}
{{- end }}

{{/* A container's preStop (dict: root, pattern): `ray stop` once no process's command line
matches `pattern` (an extended regex whose first character is bracketed, so that it does
not match this hook's own command line), or after the router's stop time. The head pod
waits for the router (its requests run on Ray's actors, which it stops last); a worker pod
for its pdserve actor (the router kills it once its requests have ended). */}}
{{- define "pdserve.preStopRayStop" -}}
preStop:
  exec:
    command:
      - /bin/sh
      - -c
      - |
        i=0
        while [ "$i" -lt {{ include "pdserve.routerStopSeconds" .root }} ] && grep -qsaE '{{ .pattern }}' /proc/[0-9]*/cmdline; do
          sleep 1
          i=$((i + 1))
        done
        ray stop
{{- end }}

{{/* Where the router container reads router.tls's Secret, and the scheme of its port:
https with router.tls.secretName, else http. */}}
{{- define "pdserve.tlsDir" -}}/etc/pdserve-tls{{- end }}
{{- define "pdserve.scheme" -}}{{ if .Values.router.tls.secretName }}https{{ else }}http{{ end }}{{- end }}
