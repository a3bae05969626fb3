{{/*
A worker pool: Deployment, headless Service (metrics discovery; workers are found through the
Redis registry by pod IP, never through this Service) and PodDisruptionBudget.
prefill.yaml, decode.yaml and aggregated.yaml render it, each with its own values: the pools
share no object, so changing one pool's values never touches the other's. The aggregated pool
runs `pdserve decode --aggregated`.
(dict "ctx" $ "component" "prefill" "values" .Values.prefill)
*/}}
{{- define "pdserve.pool" -}}
{{- $ctx := . }}
{{- $root := .ctx }}
{{- $values := .values }}
{{- $name := include "pdserve.componentName" $ctx }}
{{- $skips := include "pdserve.checkovSkips" (dict "image" $root.Values.image "secretEnv" (include "pdserve.usesSecretEnv" (dict "ctx" $root)) "securityContext" (include "pdserve.containerSecurityContext" $ctx | fromYaml)) | trim }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
  {{- with $skips }}
  annotations:
    {{- . | nindent 4 }}
  {{- end }}
spec:
  {{- /* Left out when an autoscaler or the planner owns the count: an upgrade would reset it. */}}
  {{- $planned := and $root.Values.planner.enabled (has .component (list "prefill" "decode")) }}
  {{- if not (or $values.autoscaling.enabled $planned) }}
  replicas: {{ $values.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  strategy:
    {{- toYaml $values.strategy | nindent 4 }}
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "pdserve.labels" $ctx | nindent 8 }}
      annotations:
        checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
        {{- with $values.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      {{- include "pdserve.podCommon" $ctx | nindent 6 }}
      containers:
        - name: {{ .component }}
          image: {{ include "pdserve.imageRef" (dict "image" $root.Values.image "appVersion" $root.Chart.AppVersion) }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args:
            {{- if eq .component "aggregated" }}
            - decode
            - --aggregated
            {{- else }}
            - {{ .component }}
            {{- end }}
            # Bind every interface: peers reach the pod by its IP (PDSERVE_ADVERTISE_HOST).
            - --host=0.0.0.0
            - --port={{ $values.port }}
            - --metrics-port={{ $values.metricsPort }}
          # KV transfer (NIXL/UCX or TCP) also opens worker-to-worker connections on ephemeral
          # ports; the NetworkPolicy admits peer workers on every port for that reason.
          ports:
            - {name: grpc, containerPort: {{ $values.port }}, protocol: TCP}
            - {name: metrics, containerPort: {{ $values.metricsPort }}, protocol: TCP}
          envFrom:
            - configMapRef:
                name: {{ include "pdserve.componentName" (dict "ctx" $root "component" "config") }}
          env:
            {{- include "pdserve.env" $ctx | nindent 12 }}
            {{- with $values.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- include "pdserve.probes" (merge (dict "port" $values.port) $ctx) | nindent 10 }}
          resources:
            {{- include "pdserve.resources" $ctx | nindent 12 }}
          securityContext:
            {{- include "pdserve.containerSecurityContext" $ctx | nindent 12 }}
          volumeMounts:
            {{- include "pdserve.volumeMounts" (dict "shm" $values.shmSizeLimit) | nindent 12 }}
      volumes:
        {{- include "pdserve.volumes" (merge (dict "shm" $values.shmSizeLimit) $ctx) | nindent 8 }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
spec:
  clusterIP: None
  selector:
    {{- include "pdserve.selectorLabels" $ctx | nindent 4 }}
  ports:
    - {name: grpc, port: {{ $values.port }}, targetPort: grpc, protocol: TCP, appProtocol: kubernetes.io/h2c}
    - {name: metrics, port: {{ $values.metricsPort }}, targetPort: metrics, protocol: TCP, appProtocol: http}
{{- if $values.podDisruptionBudget.enabled }}
---
# Voluntary evictions (node drains, upgrades) take one worker at a time, each draining in turn.
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "pdserve.labels" $ctx | nindent 4 }}
spec:
  maxUnavailable: {{ $values.podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" $ctx | nindent 6 }}
{{- end }}
{{- end }}
