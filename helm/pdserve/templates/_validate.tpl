{{/* Rules between values that values.schema.json cannot state. Each `fail` names the rule;
raycluster.yaml includes this first, so a bad install renders nothing. */}}
{{- define "pdserve.validate" -}}
{{- $v := .Values }}
{{- $mode := $v.serve.mode | default "pd" }}

{{- range $role := list "prefill" "decode" }}
{{- $g := index $v $role }}
{{- if gt (int $g.minReplicas) (int $g.maxReplicas) }}
{{- fail (printf "%s.minReplicas (%d) must be <= %s.maxReplicas (%d)" $role (int $g.minReplicas) $role (int $g.maxReplicas)) }}
{{- end }}
{{- if or (lt (int $g.replicas) (int $g.minReplicas)) (gt (int $g.replicas) (int $g.maxReplicas)) }}
{{- fail (printf "%s.replicas (%d) must be within [%s.minReplicas, %s.maxReplicas] = [%d, %d]" $role (int $g.replicas) $role $role (int $g.minReplicas) (int $g.maxReplicas)) }}
{{- end }}
{{- end }}

{{- if ne (eq (int $v.prefill.gpusPerPod) 0) (eq (int $v.decode.gpusPerPod) 0) }}
{{- fail (printf "prefill.gpusPerPod (%d) and decode.gpusPerPod (%d) must both be 0 (a CPU-only install) or both >= 1: pdserve runs every worker on one kind of device" (int $v.prefill.gpusPerPod) (int $v.decode.gpusPerPod)) }}
{{- end }}

{{- if lt (int $v.decode.replicas) 1 }}
{{- fail "decode.replicas must be >= 1: pdserve serve needs a decode worker to start" }}
{{- end }}
{{- if eq $mode "colocated" }}
{{- if or (ne (int $v.prefill.replicas) 0) (ne (int $v.prefill.maxReplicas) 0) }}
{{- fail (printf "serve.mode colocated runs no prefill workers: set prefill.replicas=0, prefill.minReplicas=0 and prefill.maxReplicas=0 (got replicas %d, maxReplicas %d)" (int $v.prefill.replicas) (int $v.prefill.maxReplicas)) }}
{{- end }}
{{- else if lt (int $v.prefill.replicas) 1 }}
{{- fail "prefill.replicas must be >= 1 when serve.mode is pd (use serve.mode=colocated for no prefill pool)" }}
{{- end }}

{{- $transport := $v.serve.kv_transport | default "tcp" }}
{{- if and (eq $mode "pd") (ne $transport "tcp") }}
{{- fail (printf "serve.kv_transport %s cannot move KV between the chart's pods: prefill and decode workers run in separate pods (cuda_ipc stays within one; nccl needs one fixed process group, which scaling breaks); use tcp" $transport) }}
{{- end }}

{{- $auth := $v.rayAuth.mode | toString }}
{{- if not (has $auth (list "token" "disabled")) }}
{{- fail (printf "rayAuth.mode must be token or disabled, got %q" $auth) }}
{{- end }}
{{- if and (eq $auth "disabled") $v.rayAuth.existingSecret }}
{{- fail (printf "rayAuth.existingSecret (%s) is set but rayAuth.mode is disabled: set rayAuth.mode=token to use it, or unset it" $v.rayAuth.existingSecret) }}
{{- end }}
{{- if and (eq $auth "token") (semverCompare "<2.52.0-0" $v.rayVersion) }}
{{- fail (printf "rayAuth.mode token needs Ray >= 2.52.0 (KubeRay refuses authOptions token below it), got rayVersion %s: set rayAuth.mode=disabled for an older Ray" $v.rayVersion) }}
{{- end }}
{{- range $where, $env := dict "head.env" $v.head.env "router.env" $v.router.env "prefill.env" $v.prefill.env "decode.env" $v.decode.env "tier.env" $v.tier.env }}
{{- range $e := $env }}
{{- if has $e.name (list "RAY_AUTH_MODE" "RAY_AUTH_TOKEN") }}
{{- fail (printf "%s sets %s, which the chart sets on every container from rayAuth (mode, existingSecret); remove it from %s" $where $e.name $where) }}
{{- end }}
{{- end }}
{{- end }}

{{- $cacheType := $v.cache.type | toString }}
{{- if not (has $cacheType (list "none" "emptyDir" "hostPath" "existingClaim")) }}
{{- fail (printf "cache.type must be none, emptyDir, hostPath or existingClaim, got %q" $cacheType) }}
{{- end }}
{{- if and (eq $cacheType "hostPath") (not $v.cache.hostPath) }}
{{- fail "cache.type hostPath needs cache.hostPath (the node's folder)" }}
{{- end }}
{{- if and (eq $cacheType "existingClaim") (not $v.cache.existingClaim) }}
{{- fail "cache.type existingClaim needs cache.existingClaim (the PersistentVolumeClaim's name)" }}
{{- end }}
{{- if ne $cacheType "none" }}
{{- range $role := list "prefill" "decode" }}
{{- range $e := (index $v $role).env }}
{{- if has $e.name (list "TRITON_CACHE_DIR" "HF_HOME" "PDSERVE_CACHE_DIR") }}
{{- fail (printf "%s.env sets %s, which the chart points at the cache volume (cache.type %s); remove it, or set cache.type=none" $role $e.name $cacheType) }}
{{- end }}
{{- end }}
{{- range $m := (index $v $role).volumeMounts }}
{{- if eq $m.mountPath "/var/cache/pdserve" }}
{{- fail (printf "%s.volumeMounts mounts %s, where the chart mounts the cache volume (cache.type %s); set cache.type=none to mount your own there" $role $m.mountPath $cacheType) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- $owned := dict
  "prefill_workers" "prefill.replicas x prefill.gpusPerPod"
  "decode_workers" "decode.replicas x decode.gpusPerPod"
  "pool_resources" "the chart (always true)"
  "gpus_per_worker" "prefill/decode.gpusPerPod"
  "tier_bytes" "tier.storeGiB and tier.enabled"
  "autoscale" "autoscaling.enabled"
  "min_prefill_workers" "autoscaling.prefill.minWorkers"
  "max_prefill_workers" "autoscaling.prefill.maxWorkers"
  "min_decode_workers" "autoscaling.decode.minWorkers"
  "max_decode_workers" "autoscaling.decode.maxWorkers"
  "host" "the router command line"
  "port" "the router command line"
  "ray_address" "the router command line"
  "ssl_certfile" "router.tls.secretName"
  "ssl_keyfile" "router.tls.secretName"
  "ssl_ca_certs" "router.tls.secretName and router.tls.clientCertReqs"
  "ssl_cert_reqs" "router.tls.clientCertReqs" }}
{{- range $key := keys $v.serve | sortAlpha }}
{{- $k := $key | replace "-" "_" }}
{{- if has $k (list "api_key" "admin_key") }}
{{- fail (printf "serve.%s would put a key in the ConfigMap: store it in the Secret named by auth.existingSecret (keys apiKey / adminKey) instead" $key) }}
{{- end }}
{{- if hasKey $owned $k }}
{{- fail (printf "serve.%s is set by the chart from %s; remove it from serve" $key (get $owned $k)) }}
{{- end }}
{{- end }}

{{- if eq (int $v.router.tls.clientCertReqs) 2 }}
{{- fail "router.tls.clientCertReqs 2 (required) would fail every probe: kubelet's HTTPS probes present no client certificate; use 1 (a certificate that is presented is checked) or require them at a mesh or ingress" }}
{{- end }}
{{- if and (gt (int $v.router.tls.clientCertReqs) 0) (not $v.router.tls.secretName) }}
{{- fail "router.tls.clientCertReqs needs router.tls.secretName (its ca.crt checks the clients' certificates)" }}
{{- end }}
{{- if and (hasKey $v.serve "ssl_ciphers") (not $v.router.tls.secretName) }}
{{- fail "serve.ssl_ciphers needs router.tls.secretName: the router serves plain HTTP without it" }}
{{- end }}

{{- if $v.autoscaling.enabled }}
{{- range $role := list "prefill" "decode" }}
{{- if or (eq $role "decode") (ne $mode "colocated") }}
{{- $g := index $v $role }}
{{- $lo := int (include "pdserve.workerBound" (dict "root" $ "role" $role "bound" "min")) }}
{{- $hi := int (include "pdserve.workerBound" (dict "root" $ "role" $role "bound" "max")) }}
{{- $n := int (include "pdserve.initialWorkers" (dict "Values" $v "role" $role)) }}
{{- $cap := mul (int $g.maxReplicas) (int (include "pdserve.workersPerPod" $g)) }}
{{- if gt $lo $hi }}
{{- fail (printf "autoscaling.%s.minWorkers (%d) must be <= autoscaling.%s.maxWorkers (%d)" $role $lo $role $hi) }}
{{- end }}
{{- if gt $hi $cap }}
{{- fail (printf "autoscaling.%s.maxWorkers (%d) exceeds what %s.maxReplicas pods hold (%d pods x %s workers = %d): the extra workers could never be placed" $role $hi $role (int $g.maxReplicas) (include "pdserve.workersPerPod" $g) $cap) }}
{{- end }}
{{- if or (gt $lo $n) (lt $hi $n) }}
{{- fail (printf "autoscaling.%s: the %d workers of %s.replicas must be within [minWorkers, maxWorkers] = [%d, %d]" $role $n $role $lo $hi) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
