{{/* One entry of workerGroupSpecs (dict: root, name, g = the group's values, gpus, memory,
replicas, min, max, resources = the `resources` rayStartParam, cache = whether its pods
mount the cache volume). */}}
{{- define "pdserve.workerGroup" -}}
{{- $root := .root }}
{{- $g := .g }}
{{- $cache := and .cache (include "pdserve.cacheOn" $root) }}
{{- $own := dict "num-cpus" $g.cpu "num-gpus" .gpus "resources" .resources }}
{{- if eq .name "tier" }}
{{- /* The tier's KV lives in the actor's heap, not in Ray's object store: Ray's default
(30% of the pod's memory) would take memory the store needs. */}}
{{- $_ := set $own "object-store-memory" "536870912" }}
{{- end }}
- groupName: {{ .name }}
  replicas: {{ .replicas }}
  minReplicas: {{ .min }}
  maxReplicas: {{ .max }}
  rayStartParams:
    {{- include "pdserve.rayStartParams" (dict "own" $own "extra" $g.rayStartParams) | trim | nindent 4 }}
  template:
    metadata:
      labels:
        {{- include "pdserve.labels" $root | nindent 8 }}
        app.kubernetes.io/component: {{ .name }}
        ray.io/cluster: {{ include "pdserve.fullname" $root }}
        ray.io/node-type: worker
        ray.io/group: {{ .name }}
    spec:
      terminationGracePeriodSeconds: {{ include "pdserve.terminationGraceSeconds" $root }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "pdserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          resources:
            requests:
              cpu: {{ $g.cpu | quote }}
              memory: {{ .memory | quote }}
              {{- if gt .gpus 0 }}
              nvidia.com/gpu: {{ .gpus | quote }}
              {{- end }}
            limits:
              cpu: {{ $g.cpu | quote }}
              memory: {{ .memory | quote }}
              {{- if gt .gpus 0 }}
              nvidia.com/gpu: {{ .gpus | quote }}
              {{- end }}
          env:
            {{- include "pdserve.rayAuthEnv" $root | nindent 12 }}
            {{- if $cache }}
            {{- include "pdserve.cacheEnv" $root | nindent 12 }}
            {{- end }}
            {{- with $g.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- if or $cache $g.volumeMounts }}
          volumeMounts:
            {{- if $cache }}
            - {name: pdserve-cache, mountPath: /var/cache/pdserve}
            {{- end }}
            {{- with $g.volumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- end }}
          lifecycle:
            {{- include "pdserve.preStopRayStop" (dict "root" $root "pattern" "[r]ay::([^:]*:)?(Decode|Prefill|Tier)Actor") | nindent 12 }}
      {{- if or $cache $g.volumes }}
      volumes:
        {{- if $cache }}
        {{- include "pdserve.cacheVolume" $root | nindent 8 }}
        {{- end }}
        {{- with $g.volumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
      {{- with $g.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $g.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $g.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}
