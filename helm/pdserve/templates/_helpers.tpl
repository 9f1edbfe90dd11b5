{{/*
One helper per concern. Role helpers take a context dict: root ($), role (router|prefill|decode|planner)
and v (that role's values block).
*/}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (default .Chart.Name .Values.nameOverride) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (default .Chart.Name .Values.nameOverride) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "pdserve.componentName" -}}
{{- printf "%s-%s" (include "pdserve.fullname" .root | trunc 55 | trimSuffix "-") .role }}
{{- end }}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end }}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "pdserve.servedModelName" -}}
{{- default (ternary "tiny" .Values.model.name (eq .Values.model.source "tiny")) .Values.model.servedModelName }}
{{- end }}

{{- define "pdserve.kvSecretName" -}}
{{- default (printf "%s-kv" (include "pdserve.fullname" .)) .Values.kvTransfer.secret.existingSecret }}
{{- end }}

{{- define "pdserve.authSecretName" -}}
{{- default (printf "%s-engine-auth" (include "pdserve.fullname" .)) .Values.engineAuth.token.existingSecret }}
{{- end }}

{{/* A Secret with one random value (unless `value` is given), kept across upgrades: root, name, key, value, role. */}}
{{- define "pdserve.generatedSecret" -}}
{{- $value := .value }}
{{- if not $value }}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name }}
{{- if and $existing (hasKey (default dict $existing.data) .key) }}
{{- $value = index $existing.data .key | b64dec }}
{{- else }}
{{- $value = randAlphaNum 48 }}
{{- end }}
{{- end }}
apiVersion: v1
kind: Secret
metadata:
  name: {{ .name }}
  labels: {{- include "pdserve.labels" (dict "root" .root "role" .role) | nindent 4 }}
type: Opaque
data:
  {{ .key }}: {{ $value | b64enc | quote }}
{{- end }}

{{/* Engine authentication for a role (router, prefill, decode): its environment, arguments, volume. */}}
{{- define "pdserve.engineAuthEnv" -}}
{{- $t := .root.Values.engineAuth.token }}
{{- if $t.enabled }}
- name: PDSERVE_AUTH_TOKEN  # engines demand it, the router presents it
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.authSecretName" .root }}
      key: {{ $t.key }}
{{- end }}
{{- end }}

{{- define "pdserve.engineAuthArgs" -}}
{{- $tls := .root.Values.engineAuth.tls }}
{{- if $tls.enabled }}
{{- if eq .role "router" }}
- --engine-ssl-ca-certs=/etc/pdserve/tls/ca.crt
- --engine-ssl-certfile=/etc/pdserve/tls/tls.crt
- --engine-ssl-keyfile=/etc/pdserve/tls/tls.key
- --engine-ssl-server-name={{ default (printf "%s-engine" (include "pdserve.fullname" .root)) $tls.serverName }}
{{- else }}
- --ssl-certfile=/etc/pdserve/tls/tls.crt
- --ssl-keyfile=/etc/pdserve/tls/tls.key
- --ssl-ca-certs=/etc/pdserve/tls/ca.crt
- --health-port={{ $tls.healthPort }}
{{- end }}
{{- end }}
{{- end }}

{{/* Ranks one engine is sharded over (1 for the router and the planner). */}}
{{- define "pdserve.tensorParallelSize" -}}
{{- int (default 1 .v.tensorParallelSize) }}
{{- end }}

{{/* A CPU engine's torch threads per rank when tensor parallel: its CPU limit split over the ranks
(floor, at least 1). Left to the engine otherwise, whose default splits os.cpu_count(): the node's
cores, not the pod's limit. "" on accelerators, without a CPU limit, or at one rank. */}}
{{- define "pdserve.cpuThreadsPerRank" -}}
{{- $tp := int (include "pdserve.tensorParallelSize" .) }}
{{- $cpu := toString (dig "limits" "cpu" "" (default dict .v.resources)) }}
{{- $onCPU := or (eq (int .v.accelerator.count) 0) (eq .root.Values.engine.device "cpu") }}
{{- if and $onCPU $cpu (gt $tp 1) }}
{{- $cores := ternary (divf (trimSuffix "m" $cpu) 1000) (float64 $cpu) (hasSuffix "m" $cpu) }}
{{- max 1 (int (floor (divf $cores $tp))) }}
{{- end }}
{{- end }}

{{- define "pdserve.grpcPort" -}}
{{- if eq .role "router" }}{{ .root.Values.router.grpcPort }}{{ else }}{{ index .root.Values.engine.grpcPorts .role }}{{ end }}
{{- end }}

{{/* vLLM's --kv-events-config JSON of an engine (ctx: root, role). On the host network (the shm
transport: a prefill and a decode per node, side by side) both bind port 0, the OS picks free ones,
and each engine advertises what it bound through GetLoad, where the router learns it. */}}
{{- define "pdserve.kvEventsConfig" -}}
{{- $e := .root.Values.kvEvents }}
{{- $host := eq .root.Values.kvTransfer.transport "shm" }}
{{- $config := dict "enable_kv_cache_events" true "publisher" "zmq"
      "endpoint" (printf "tcp://*:%d" (ternary 0 (int $e.port) $host))
      "replay_endpoint" (printf "tcp://*:%d" (ternary 0 (int $e.replayPort) $host))
      "buffer_steps" (int $e.bufferSteps) "hwm" (int $e.hwm) "max_queue_size" (int $e.maxQueueSize)
      "topic" $e.topic }}
{{- toJson $config }}
{{- end }}

{{/* The router's --policy: kv_aware where the engines publish KV events, unless set. */}}
{{- define "pdserve.routerPolicy" -}}
{{- .Values.router.policy | default (ternary "kv_aware" "least_load" .Values.kvEvents.enabled) }}
{{- end }}

{{/* "hpa", "planner" or "": who owns the role's replica count (then the Deployment leaves it unset). */}}
{{- define "pdserve.scaledBy" -}}
{{- $planner := .root.Values.planner }}
{{- if .v.autoscaling.enabled }}hpa
{{- else if and $planner.enabled (ne .role "router") (index $planner .role).enabled }}planner
{{- end }}
{{- end }}

{{/* What values.schema.json cannot say. */}}
{{- define "pdserve.validate" -}}
{{- range $role := list "router" "prefill" "decode" }}
{{- $a := (index $.Values $role).autoscaling }}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) }}
{{- fail (printf "%s.autoscaling: minReplicas (%v) is above maxReplicas (%v)" $role $a.minReplicas $a.maxReplicas) }}
{{- end }}
{{- end }}
{{- if and .Values.engineAuth.tls.enabled (not .Values.engineAuth.tls.secretName) }}
{{- fail "engineAuth.tls.enabled: name the Secret holding tls.crt, tls.key and ca.crt in engineAuth.tls.secretName" }}
{{- end }}
{{- if and (ne .Values.router.tls.clientCertificates "none") (not .Values.router.tls.secretName) }}
{{- fail "router.tls.clientCertificates: name the Secret holding tls.crt, tls.key and ca.crt in router.tls.secretName" }}
{{- end }}
{{- with .Values.engine.lora.maxCpuLoras }}
{{- if not $.Values.engine.lora.maxLoras }}
{{- fail "engine.lora.maxCpuLoras caps the adapters in host memory, which only engine.lora.maxLoras puts there: set it too" }}
{{- else if lt (int .) (int $.Values.engine.lora.maxLoras) }}
{{- fail (printf "engine.lora.maxCpuLoras (%d) must be >= engine.lora.maxLoras (%d)" (int .) (int $.Values.engine.lora.maxLoras)) }}
{{- end }}
{{- end }}
{{- if and .Values.engine.lora.resolverDir (not .Values.engine.lora.runtimeUpdating) }}
{{- fail "engine.lora.resolverDir loads adapters at run time: set engine.lora.runtimeUpdating too" }}
{{- end }}
{{- if and .Values.engine.kvCacheMemoryGb .Values.engine.gpuMemoryUtilization }}
{{- fail "engine.gpuMemoryUtilization: engine.kvCacheMemoryGb sizes the KV cache too: give one" }}
{{- end }}
{{- if and .Values.planner.enabled (not (or .Values.planner.prefill.enabled .Values.planner.decode.enabled)) }}
{{- fail "planner.enabled: the planner scales nothing: enable planner.prefill and/or planner.decode" }}
{{- end }}
{{- $e := .Values.kvEvents }}
{{- if $e.enabled }}
{{- $taken := dict (toString .Values.engine.metricsPort) "engine.metricsPort" (toString .Values.kvTransfer.port) "kvTransfer.port"
      (toString .Values.engine.grpcPorts.prefill) "engine.grpcPorts.prefill" (toString .Values.engine.grpcPorts.decode) "engine.grpcPorts.decode" }}
{{- if .Values.engineAuth.tls.enabled }}{{ $_ := set $taken (toString .Values.engineAuth.tls.healthPort) "engineAuth.tls.healthPort" }}{{ end }}
{{- range $key := list "port" "replayPort" }}
{{- $port := toString (index $e $key) }}
{{- with index $taken $port }}
{{- fail (printf "kvEvents.%s: port %s is already %s's" $key $port .) }}
{{- end }}
{{- $_ := set $taken $port (printf "kvEvents.%s" $key) }}
{{- end }}
{{- end }}
{{- $prefillTp := int (include "pdserve.tensorParallelSize" (dict "v" .Values.prefill)) }}
{{- if gt $prefillTp 1 }}
{{- $kvPort := int .Values.kvTransfer.port }}
{{- $lastPort := add $kvPort (sub $prefillTp 1) }}
{{- if gt $lastPort 65535 }}
{{- fail (printf "kvTransfer.port %d: the prefill's %d tensor-parallel ranks listen on ports %d..%d, past 65535" $kvPort $prefillTp $kvPort $lastPort) }}
{{- end }}
{{- $others := dict (toString .Values.engine.metricsPort) "engine.metricsPort" (toString .Values.engine.grpcPorts.prefill) "engine.grpcPorts.prefill" }}
{{- if .Values.engineAuth.tls.enabled }}{{ $_ := set $others (toString .Values.engineAuth.tls.healthPort) "engineAuth.tls.healthPort" }}{{ end }}
{{- if .Values.kvEvents.enabled }}{{ $_ := set $others (toString .Values.kvEvents.port) "kvEvents.port" }}{{ $_ := set $others (toString .Values.kvEvents.replayPort) "kvEvents.replayPort" }}{{ end }}
{{- range $r := untilStep 1 $prefillTp 1 }}
{{- with index $others (toString (add $kvPort $r)) }}
{{- fail (printf "kvTransfer.port %d: prefill tensor-parallel rank %d listens on port %d, which is already %s's" $kvPort $r (add $kvPort $r) .) }}
{{- end }}
{{- end }}
{{- end }}
{{- $device := .Values.engine.device }}
{{- range $role := list "prefill" "decode" }}
{{- $v := index $.Values $role }}
{{- $tp := int (include "pdserve.tensorParallelSize" (dict "v" $v)) }}
{{- $gpus := mul $v.accelerator.count $tp }}
{{- if and (gt (int $gpus) 0) (hasPrefix "cuda:" $device) }}
{{- $base := int (trimPrefix "cuda:" $device) }}
{{- if lt (int $gpus) (add $base $tp) }}
{{- fail (printf "engine.device %s puts %s's ranks on cuda:%d..cuda:%d, but its pods see %d GPU(s), numbered from cuda:0 (%s.accelerator.count %v x tensorParallelSize %d): use cuda or auto" $device $role $base (sub (add $base $tp) 1) $gpus $role $v.accelerator.count $tp) }}
{{- end }}
{{- end }}
{{- end }}
{{- range $role := list "prefill" "decode" }}
{{- $p := index $.Values.planner $role }}
{{- if gt (int $p.minReplicas) (int $p.maxReplicas) }}
{{- fail (printf "planner.%s: minReplicas (%v) is above maxReplicas (%v)" $role $p.minReplicas $p.maxReplicas) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The checkpoint as the pdserve CLI takes it. */}}
{{- define "pdserve.modelPath" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "tiny" }}tiny
{{- else if eq $m.source "huggingface" }}/models/model
{{- else }}{{ printf "/models/%s" ($m.path | trimPrefix "/") | trimSuffix "/" }}
{{- end }}
{{- end }}

{{/* Requests and limits; extended resources (GPUs, RDMA NICs) get requests = limits. An engine's
accelerators are per tensor-parallel rank: the pod asks count x tensorParallelSize (set count 0 to
write the GPUs into resources yourself: then nothing is derived). */}}
{{- define "pdserve.resources" -}}
{{- $res := deepCopy (default dict .v.resources) }}
{{- $requests := default dict $res.requests }}
{{- $limits := default dict $res.limits }}
{{- if gt (int .v.accelerator.count) 0 }}
{{- $_ := set $limits .v.accelerator.resourceName (mul .v.accelerator.count (include "pdserve.tensorParallelSize" .)) }}
{{- end }}
{{- $rdma := .root.Values.kvTransfer.rdma }}
{{- if and $rdma.enabled (has .role (list "prefill" "decode")) }}
{{- $_ := set $limits $rdma.resourceName $rdma.count }}
{{- end }}
{{- range $name, $count := $limits }}
{{- if contains "/" $name }}
{{- $_ := set $requests $name $count }}
{{- end }}
{{- end }}
{{- $_ := set $res "requests" $requests }}
{{- $_ := set $res "limits" $limits }}
{{- toYaml $res }}
{{- end }}

{{- define "pdserve.containerSecurityContext" -}}
{{- $sc := deepCopy .root.Values.securityContext }}
{{- if and .root.Values.kvTransfer.rdma.enabled (has .role (list "prefill" "decode")) }}
{{- /* RDMA registers (pins) memory: IPC_LOCK lifts the memlock limit */}}
{{- $caps := default dict $sc.capabilities }}
{{- $_ := set $caps "add" (append (default list $caps.add) "IPC_LOCK") }}
{{- $_ := set $sc "capabilities" $caps }}
{{- end }}
{{- toYaml $sc }}
{{- end }}

{{/* Pod-level settings every role shares: scheduling, identity, security. */}}
{{- define "pdserve.podSpec" -}}
serviceAccountName: {{ include "pdserve.componentName" (dict "root" .root "role" (ternary "engine" .role (has .role (list "prefill" "decode")))) }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
securityContext: {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .v.terminationGracePeriodSeconds }}
terminationGracePeriodSeconds: {{ . }}
{{- end }}
{{- with .v.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .v.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .v.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .v.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .v.topologySpreadConstraints }}
topologySpreadConstraints: {{- toYaml . | nindent 2 }}
{{- end }}
{{- if .v.affinity }}
affinity: {{- toYaml .v.affinity | nindent 2 }}
{{- else if and (eq .root.Values.kvTransfer.transport "shm") (has .role (list "prefill" "decode")) }}
affinity: {{- include "pdserve.shmAffinity" . | trim | nindent 2 }}
{{- end }}
{{- end }}

{{/* shm: one prefill and one decode per node, side by side (host network: one port each per node). */}}
{{- define "pdserve.shmAffinity" -}}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchLabels: {{- include "pdserve.selectorLabels" . | nindent 10 }}
{{- if eq .role "decode" }}
podAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchLabels: {{- include "pdserve.selectorLabels" (dict "root" .root "role" "prefill") | nindent 10 }}
{{- end }}
{{- end }}

{{- define "pdserve.podAnnotations" -}}
{{- $ann := deepCopy (default dict .v.podAnnotations) }}
{{- if and .root.Values.metrics.podAnnotations (ne .role "planner") }}
{{- $_ := set $ann "prometheus.io/scrape" "true" }}
{{- $_ := set $ann "prometheus.io/path" "/metrics" }}
{{- $_ := set $ann "prometheus.io/port" (toString (ternary .root.Values.router.httpPort .root.Values.engine.metricsPort (eq .role "router"))) }}
{{- if and (eq .role "router") .root.Values.router.tls.secretName }}
{{- $_ := set $ann "prometheus.io/scheme" "https" }}
{{- end }}
{{- end }}
{{- with $ann }}{{ toYaml . }}{{ end }}
{{- end }}

{{/* Writable places under a read-only root filesystem: caches (HF, Triton, torch, the CPU kernels), /tmp. */}}
{{- define "pdserve.cacheEnv" -}}
- name: HOME
  value: /home/pdserve
- name: XDG_CACHE_HOME
  value: /home/pdserve/.cache
- name: HF_HOME
  value: /home/pdserve/.cache/huggingface
- name: PDSERVE_CACHE_DIR
  value: /home/pdserve/.cache/pdserve
- name: TRITON_CACHE_DIR
  value: /home/pdserve/.cache/triton
- name: TORCHINDUCTOR_CACHE_DIR
  value: /home/pdserve/.cache/torchinductor
{{- end }}

{{- define "pdserve.volumeMounts" -}}
{{- if ne .root.Values.model.source "tiny" }}
- name: model
  mountPath: /models
  readOnly: true
{{- end }}
- name: cache
  mountPath: /home/pdserve/.cache
- name: tmp
  mountPath: /tmp
{{- if has .role (list "prefill" "decode") }}
- name: dshm
  mountPath: /dev/shm
{{- end }}
{{- if .root.Values.engineAuth.tls.enabled }}
- name: engine-tls
  mountPath: /etc/pdserve/tls
  readOnly: true
{{- end }}
{{- if and (eq .role "router") .root.Values.router.tls.secretName }}
- name: router-tls
  mountPath: /etc/pdserve/router-tls
  readOnly: true
{{- end }}
{{- end }}

{{- define "pdserve.volumes" -}}
{{- $m := .root.Values.model }}
{{- if eq $m.source "huggingface" }}
- name: model
  emptyDir:
    sizeLimit: {{ $m.downloadSizeLimit }}
{{- else if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ $m.hostPath.path }}
    type: Directory
{{- end }}
- name: cache
  emptyDir: {}
- name: tmp
  emptyDir: {}
{{- if has .role (list "prefill" "decode") }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .root.Values.kvTransfer.shm.sizeLimit }}
{{- end }}
{{- with .root.Values.engineAuth.tls }}
{{- if .enabled }}
- name: engine-tls
  secret:
    secretName: {{ .secretName }}
    defaultMode: 0440
{{- end }}
{{- end }}
{{- if eq .role "router" }}
{{- with .root.Values.router.tls.secretName }}
- name: router-tls
  secret:
    secretName: {{ . }}
    defaultMode: 0440
{{- end }}
{{- end }}
{{- end }}

{{/* huggingface: fetch the checkpoint before the server starts (the router needs only the tokenizer). */}}
{{- define "pdserve.initContainers" -}}
{{- $m := .root.Values.model }}
{{- if eq $m.source "huggingface" }}
- name: download-model
  image: {{ include "pdserve.image" .root }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  command:
    - python
    - -c
    - |
      import os
      from huggingface_hub import snapshot_download
      patterns = os.environ.get("ALLOW_PATTERNS")
      path = snapshot_download(os.environ["MODEL_ID"], revision=os.environ["MODEL_REVISION"],
                               local_dir="/models/model", allow_patterns=patterns.split(",") if patterns else None)
      print(f"downloaded {os.environ['MODEL_ID']}@{os.environ['MODEL_REVISION']} to {path}", flush=True)
  env:
    - name: MODEL_ID
      value: {{ $m.name | quote }}
    - name: MODEL_REVISION
      value: {{ $m.revision | quote }}
    {{- if eq .role "router" }}
    - name: ALLOW_PATTERNS
      value: "*.json,*.jinja,*.txt,*.model,*.tiktoken"
    {{- end }}
    {{- with $m.hfTokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $m.hfTokenSecret.key }}
    {{- end }}
    {{- include "pdserve.cacheEnv" . | trim | nindent 4 }}
  securityContext: {{- toYaml .root.Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: model
      mountPath: /models
    - name: cache
      mountPath: /home/pdserve/.cache
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}

{{/* The router: alive (/livez) is not ready (/readyz, an engine reachable): an engine outage must not
restart routers. Engines: gRPC health, on the plaintext health port when the gRPC port wants TLS. */}}
{{- define "pdserve.probes" -}}
{{- $live := "" }}
{{- $ready := "" }}
{{- if eq .role "router" }}
{{- $tls := .root.Values.router.tls }}
{{- if eq $tls.clientCertificates "required" }}
{{- $live = dict "tcpSocket" (dict "port" "http") }}
{{- $ready = $live }}
{{- else }}
{{- $live = dict "httpGet" (dict "path" "/livez" "port" "http") }}
{{- $ready = dict "httpGet" (dict "path" "/readyz" "port" "http") }}
{{- if $tls.secretName }}
{{- $_ := set $live.httpGet "scheme" "HTTPS" }}
{{- $_ := set $ready.httpGet "scheme" "HTTPS" }}
{{- end }}
{{- end }}
{{- else }}
{{- $tls := .root.Values.engineAuth.tls }}
{{- $live = dict "grpc" (dict "port" (int (ternary $tls.healthPort (include "pdserve.grpcPort" .) $tls.enabled))) }}
{{- $ready = $live }}
{{- end }}
startupProbe: {{- toYaml (merge (deepCopy .v.probes.startup) $live) | nindent 2 }}
readinessProbe: {{- toYaml (merge (deepCopy .v.probes.readiness) $ready) | nindent 2 }}
livenessProbe: {{- toYaml (merge (deepCopy .v.probes.liveness) $live) | nindent 2 }}
{{- end }}
