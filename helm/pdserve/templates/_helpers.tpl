{{/* Names, labels and the pod pieces that the router, prefill and decode share. */}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-scoped base name; component names append "-router", "-prefill", ... */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The worker pools this release deploys, as a JSON list (the aggregated one is optional). */}}
{{- define "pdserve.workerPools" -}}
{{- $pools := list "prefill" "decode" }}
{{- if .Values.aggregated.enabled }}
{{- $pools = append $pools "aggregated" }}
{{- end }}
{{- toJson $pools }}
{{- end }}

{{/* (dict "ctx" $ "component" "prefill") -> "<fullname>-prefill" */}}
{{- define "pdserve.componentName" -}}
{{- printf "%s-%s" (include "pdserve.fullname" .ctx) .component }}
{{- end }}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/part-of: pdserve
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end }}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* An image reference: the digest pins it when given, else the tag. */}}
{{- define "pdserve.imageRef" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository (.image.tag | default .appVersion | toString) }}
{{- end }}
{{- end }}

{{- define "pdserve.apiKeySecretName" -}}
{{- .Values.router.apiKey.existingSecret | default (printf "%s-api-key" (include "pdserve.fullname" .)) }}
{{- end }}

{{- define "pdserve.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s:%v/0" (include "pdserve.componentName" (dict "ctx" . "component" "redis")) .Values.redis.port }}
{{- else }}
{{- .Values.redis.external.url }}
{{- end }}
{{- end }}

{{/*
The whole shutdown budget: preStop sleep, then SIGTERM starts the drain (deregister, refuse new
work, finish in-flight work within PDSERVE_DRAIN_GRACE_S), plus 15 s to exit. Derived here so
that the kubelet can never SIGKILL a worker that is still inside its drain grace.
(dict "ctx" $ "values" .Values.prefill)
*/}}
{{- define "pdserve.terminationGracePeriodSeconds" -}}
{{- add .values.preStopSleepSeconds .ctx.Values.engine.drainGraceSeconds 15 }}
{{- end }}

{{/*
checkov suppressions, each rendered only while its cause is in the values, with its reason.
checkov reads `checkov.io/skip*` annotations on the workload (reasons must not contain "=").
(dict "image" .Values.image "secretEnv" bool "securityContext" merged-container-context)
*/}}
{{- define "pdserve.checkovSkips" -}}
{{- if not .image.digest }}
checkov.io/skip1: "CKV_K8S_43=The chart can only default to tags: the pdserve digest exists once its image is built, and pinning Redis is the installer's call. Set image.digest or redis.image.digest to pin."
{{- end }}
{{- if .secretEnv }}
checkov.io/skip2: "CKV_K8S_35=The pdserve CLI takes PDSERVE_API_KEY and REDIS_URL from its environment only, so the Secret is passed as secretKeyRef."
{{- end }}
{{- if (.securityContext.capabilities | default dict).add }}
checkov.io/skip3: "CKV_K8S_25=Capabilities are added on purpose through containerSecurityContext (UCX needs IPC_LOCK to register memory for RDMA)."
{{- end }}
{{- end }}

{{/*
Pod-level settings common to every pdserve role.
(dict "ctx" $ "component" "prefill" "values" .Values.prefill)
*/}}
{{- define "pdserve.podCommon" -}}
serviceAccountName: {{ include "pdserve.serviceAccountName" .ctx }}
automountServiceAccountToken: false
enableServiceLinks: false
securityContext:
  {{- toYaml .ctx.Values.podSecurityContext | nindent 2 }}
{{- with .ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
terminationGracePeriodSeconds: {{ include "pdserve.terminationGracePeriodSeconds" . }}
{{- end }}

{{- define "pdserve.containerSecurityContext" -}}
{{- toYaml (mergeOverwrite (deepCopy .ctx.Values.securityContext) .values.containerSecurityContext) }}
{{- end }}

{{/*
Environment every role gets besides the ConfigMap: identity from the downward API, the
writable cache paths, the Secrets, and per-role overrides (env wins over envFrom).
*/}}
{{- define "pdserve.env" -}}
- name: PDSERVE_ADVERTISE_HOST
  valueFrom:
    fieldRef: {fieldPath: status.podIP}
- name: PDSERVE_WORKER_ID
  valueFrom:
    fieldRef: {fieldPath: metadata.name}
- name: PDSERVE_CACHE
  value: /cache/pdserve
- name: XDG_CACHE_HOME
  value: /cache
- name: HF_HOME
  value: /cache/huggingface
{{- if and (not .ctx.Values.redis.enabled) .ctx.Values.redis.external.existingSecret }}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .ctx.Values.redis.external.existingSecret }}
      key: {{ .ctx.Values.redis.external.secretKey }}
{{- end }}
{{- if not (kindIs "invalid" .values.threads) }}
- name: PDSERVE_THREADS
  value: {{ .values.threads | toString | quote }}
{{- end }}
{{- if not (kindIs "invalid" .values.numBlocks) }}
- name: PDSERVE_NUM_BLOCKS
  value: {{ .values.numBlocks | toString | quote }}
{{- end }}
{{- if hasKey .values "gpus" }}
{{- include "pdserve.deviceEnv" . }}
{{- end }}
{{- end }}

{{/*
A worker pool's device: PDSERVE_DEVICE (empty `device` follows `gpus`), CUDA graphs, and the
caches CUDA and FlashInfer's JIT write (the root filesystem is read-only; /cache is writable).
*/}}
{{- define "pdserve.deviceEnv" -}}
{{- $gpus := int (.values.gpus | default 0) }}
{{- $device := .values.device | default (ternary "cuda" "cpu" (gt $gpus 0)) }}
{{- if and (hasPrefix "cuda" $device) (eq $gpus 0) }}
{{- fail (printf "%s.device=%s needs %s.gpus >= 1 (the pod would see no GPU)" .component $device .component) }}
{{- end }}
{{- if hasPrefix "cuda:" $device }}
{{- $index := int (trimPrefix "cuda:" $device) }}
{{- if ge $index $gpus }}
{{- fail (printf "%s.device=%s, but the pod gets %d GPU(s), numbered cuda:0..cuda:%d" .component $device $gpus (sub $gpus 1)) }}
{{- end }}
{{- end }}
- name: PDSERVE_DEVICE
  value: {{ $device | quote }}
- name: PDSERVE_CUDA_GRAPHS
  value: {{ .values.cudaGraphs | default false | toString | quote }}
{{- if gt $gpus 0 }}
- name: CUDA_CACHE_PATH
  value: /cache/nv
- name: FLASHINFER_WORKSPACE_BASE
  value: /cache
{{- end }}
{{- end }}

{{/* Whether a role gets a Secret in its environment: (dict "ctx" $ "apiKey" bool) */}}
{{- define "pdserve.usesSecretEnv" -}}
{{- if or (and (not .ctx.Values.redis.enabled) .ctx.Values.redis.external.existingSecret) .apiKey }}true{{ end }}
{{- end }}

{{/* The native gRPC probes (grpc.health.v1 on the role's gRPC port) and the preStop hook. */}}
{{- define "pdserve.probes" -}}
startupProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: 10
  failureThreshold: {{ max 1 (div .values.startupTimeoutSeconds 10) }}
readinessProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: 5
  timeoutSeconds: 2
  failureThreshold: 2
livenessProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
lifecycle:
  preStop:
    exec:
      command: ["sleep", "{{ .values.preStopSleepSeconds }}"]
{{- end }}

{{- define "pdserve.volumeMounts" -}}
- {name: cache, mountPath: /cache}
- {name: tmp, mountPath: /tmp}
{{- if .shm }}
- {name: shm, mountPath: /dev/shm}
{{- end }}
{{- end }}

{{- define "pdserve.volumes" -}}
{{- if .ctx.Values.cache.existingClaim }}
- name: cache
  persistentVolumeClaim:
    claimName: {{ .ctx.Values.cache.existingClaim }}
{{- else }}
- name: cache
  emptyDir:
    sizeLimit: {{ .ctx.Values.cache.sizeLimit }}
{{- end }}
- name: tmp
  emptyDir:
    sizeLimit: {{ .ctx.Values.tmpSizeLimit }}
{{- if .shm }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shm }}
{{- end }}
{{- end }}

{{/*
Container resources with the pool's GPUs added to requests and limits (equal, as extended
resources require).
*/}}
{{- define "pdserve.resources" -}}
{{- $resources := deepCopy .values.resources }}
{{- if gt (int (.values.gpus | default 0)) 0 }}
{{- $_ := set $resources "requests" (merge (dict "nvidia.com/gpu" (int .values.gpus)) ($resources.requests | default dict)) }}
{{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" (int .values.gpus)) ($resources.limits | default dict)) }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/*
What KEDA asks Prometheus for each pool signal. A gauge is summed over the pool and compared
as an AverageValue (the HPA divides by the replica count: the per-pod target, as with the
plain HPA); the queue-wait p90 is already per pool, so it is compared as a Value.
(dict "ctx" $ "component" "prefill" "values" .Values.prefill)
*/}}
{{- define "pdserve.autoscalingSignal" -}}
{{- $pods := printf "namespace=\"%s\",pod=~\"%s-[a-z0-9]+-[a-z0-9]+\"" .ctx.Release.Namespace (include "pdserve.componentName" .) }}
{{- $metric := .values.autoscaling.metric }}
{{- if eq $metric "pdserve_prefill_queue_wait_seconds_p90" }}
kedaMetricType: Value
kedaQuery: {{ printf "histogram_quantile(0.9, sum by (le) (rate(pdserve_prefill_queue_wait_seconds_bucket{%s}[2m])))" $pods | quote }}
{{- else }}
kedaMetricType: AverageValue
kedaQuery: {{ printf "sum(%s{%s})" $metric $pods | quote }}
{{- end }}
{{- end }}
