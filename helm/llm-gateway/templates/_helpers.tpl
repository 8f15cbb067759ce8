{{/* Names, labels, and the policy file the chart derives from its values. */}}

{{- define "llm-gateway.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "llm-gateway.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "gateway") */}}
{{- define "llm-gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "llm-gateway.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "llm-gateway.labels" -}}
{{ include "llm-gateway.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "llm-gateway.serviceAccountName" -}}
{{- if .Values.gateway.serviceAccount.create -}}
{{- default (include "llm-gateway.fullname" .) .Values.gateway.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.gateway.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* A model's DNS-label id: its `id`, or its name lowercased with anything else turned into "-". */}}
{{- define "llm-gateway.modelId" -}}
{{- $id := .id | default (regexReplaceAll "[^a-z0-9-]+" (lower .name) "-") -}}
{{- $id | trimAll "-" | trunc 30 | trimSuffix "-" -}}
{{- end -}}

{{/* (dict "root" $ "model" $m "index" $i): the Deployment and Service of one vLLM replica */}}
{{- define "llm-gateway.vllmName" -}}
{{- printf "%s-vllm-%s-%d" (include "llm-gateway.fullname" .root | trunc 24 | trimSuffix "-") (include "llm-gateway.modelId" .model) (int .index) -}}
{{- end -}}

{{/* (dict "root" $ "model" $m): the one Deployment and Service of a model whose vLLM replicas KEDA scales */}}
{{- define "llm-gateway.vllmScaledName" -}}
{{- printf "%s-vllm-%s" (include "llm-gateway.fullname" .root | trunc 24 | trimSuffix "-") (include "llm-gateway.modelId" .model) -}}
{{- end -}}

{{/* (dict "root" $ "model" $m): the model's autoscaling values (vllm or kserve), as YAML; `enabled` false for
     other backends. With it on, a ScaledObject (templates/scaledobject.yaml) scales the model on GET /scaling. */}}
{{- define "llm-gateway.autoscaling" -}}
{{- $a := dict "enabled" false -}}
{{- if eq .model.backend "vllm" -}}
{{- $a = (include "llm-gateway.vllm" . | fromYaml).autoscaling | default $a -}}
{{- else if eq .model.backend "kserve" -}}
{{- $a = (include "llm-gateway.kserve" . | fromYaml).autoscaling | default $a -}}
{{- end -}}
{{- toYaml $a -}}
{{- end -}}

{{/* (dict "root" $ "model" $m): the policy's autoscaling block of a model that autoscales */}}
{{- define "llm-gateway.policyAutoscaling" -}}
{{- $a := include "llm-gateway.autoscaling" . | fromYaml -}}
{{- toYaml (dict "headroom" $a.headroom "smoothing_seconds" $a.smoothingSeconds "cold_start_wait" $a.coldStartWait "replica_cap" (int .model.cap)) -}}
{{- end -}}

{{/* (dict "root" $ "model" $m): the InferenceService (KServe adds "-predictor" and more to its names) */}}
{{- define "llm-gateway.isvcName" -}}
{{- printf "%s-%s" (include "llm-gateway.fullname" .root | trunc 16 | trimSuffix "-") (include "llm-gateway.modelId" .model) | trunc 45 | trimSuffix "-" -}}
{{- end -}}

{{- define "llm-gateway.vllm" -}}
{{- toYaml (mergeOverwrite (deepCopy .root.Values.vllmDefaults) (deepCopy (default dict .model.vllm))) -}}
{{- end -}}

{{- define "llm-gateway.kserve" -}}
{{- toYaml (mergeOverwrite (deepCopy .root.Values.kserveDefaults) (deepCopy (default dict .model.kserve))) -}}
{{- end -}}

{{- define "llm-gateway.redisName" -}}
{{- printf "%s-redis" (include "llm-gateway.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* "redis" when the gateway's store is Redis (bundled or external), else "sqlite" */}}
{{- define "llm-gateway.storeKind" -}}
{{- $e := .Values.redis.external -}}
{{- if or .Values.redis.enabled $e.url $e.sentinel.addresses $e.cluster.nodes -}}redis{{- else -}}sqlite{{- end -}}
{{- end -}}

{{/* The Secret and key holding the Redis password; empty when there is none */}}
{{- define "llm-gateway.redisSecret" -}}
{{- if .Values.redis.enabled -}}
{{- dict "name" (.Values.redis.auth.existingSecret | default (include "llm-gateway.redisName" .)) "key" (ternary .Values.redis.auth.existingSecretKey "redis-password" (ne .Values.redis.auth.existingSecret "")) | toYaml -}}
{{- else if and .Values.redis.external.existingSecret (or .Values.redis.external.url .Values.redis.external.sentinel.addresses .Values.redis.external.cluster.nodes) -}}
{{- dict "name" .Values.redis.external.existingSecret "key" .Values.redis.external.existingSecretKey | toYaml -}}
{{- end -}}
{{- end -}}

{{- define "llm-gateway.providerEnv" -}}
{{- printf "LLM_GATEWAY_PROVIDER_%s_API_KEY" (regexReplaceAll "[^A-Z0-9]+" (upper .) "_") -}}
{{- end -}}

{{/* The env var that carries a tracing export header's value (policy tracing.headers_from_env) */}}
{{- define "llm-gateway.tracingHeaderEnv" -}}
{{- printf "LLM_GATEWAY_OTLP_HEADER_%s" (regexReplaceAll "[^A-Z0-9]+" (upper .) "_") -}}
{{- end -}}

{{/* The tracing collector's port, from tracing.endpoint (its scheme's default when the URL names none) */}}
{{- define "llm-gateway.collectorPort" -}}
{{- $u := urlParse .Values.tracing.endpoint -}}
{{- (regexFind ":[0-9]+$" $u.host | trimPrefix ":") | default (ternary "443" "80" (eq $u.scheme "https")) -}}
{{- end -}}

{{/* Render-time checks: a values file that cannot work fails here, saying why. */}}
{{- define "llm-gateway.validate" -}}
{{- $v := .Values -}}
{{- if and (eq (include "llm-gateway.storeKind" .) "sqlite") (or (gt (int $v.gateway.replicas) 1) $v.gateway.autoscaling.enabled) -}}
{{- fail (printf "gateway.replicas is %d%s but the store is the embedded SQLite file: each replica would keep its own keys and rate limits. Set redis.enabled=true (bundled) or redis.external.url, or run one replica." (int $v.gateway.replicas) (ternary " with autoscaling" "" $v.gateway.autoscaling.enabled)) -}}
{{- end -}}
{{- $ways := 0 -}}
{{- range $set := list $v.redis.enabled $v.redis.external.url $v.redis.external.sentinel.addresses $v.redis.external.cluster.nodes -}}{{- if $set -}}{{- $ways = add1 $ways -}}{{- end -}}{{- end -}}
{{- if gt $ways 1 -}}
{{- fail "choose one Redis: redis.enabled (bundled), redis.external.url, redis.external.sentinel.addresses or redis.external.cluster.nodes" -}}
{{- end -}}
{{- if and $v.redis.external.url (regexMatch "^rediss?://[^/@]*:[^/@]*@" $v.redis.external.url) -}}
{{- fail "redis.external.url carries a password: it would land in the policy ConfigMap; put it in a Secret and name it in redis.external.existingSecret" -}}
{{- end -}}
{{- $files := $v.gateway.batchFiles -}}
{{- if and $files.enabled (or (gt (int $v.gateway.replicas) 1) $v.gateway.autoscaling.enabled) (not (has "ReadWriteMany" $files.persistence.accessModes)) -}}
{{- fail "gateway.batchFiles: more than one gateway replica reads and writes the Batch API's files: set gateway.batchFiles.persistence.accessModes to [ReadWriteMany] (a class that supports it), or gateway.batchFiles.enabled=false" -}}
{{- end -}}
{{- if not $v.models -}}
{{- fail "models is empty: name at least one model and its backend (vllm, kserve or external)" -}}
{{- end -}}
{{- range $key := list "listen" "store" "models" "providers" "tracing" -}}
{{- if hasKey (default dict $v.policy) $key -}}
{{- fail (printf "policy.%s is derived by the chart: use the chart's values (see the chart README) instead" $key) -}}
{{- end -}}
{{- end -}}
{{- $ids := dict -}}
{{- range $m := $v.models -}}
{{- $id := include "llm-gateway.modelId" $m -}}
{{- if hasKey $ids $id -}}
{{- fail (printf "models %s and %s share the id %q: give one of them an `id`" (get $ids $id) $m.name $id) -}}
{{- end -}}
{{- $_ := set $ids $id $m.name -}}
{{- if eq $m.backend "vllm" -}}
{{- $vl := include "llm-gateway.vllm" (dict "root" $ "model" $m) | fromYaml -}}
{{- if not $vl.model -}}
{{- fail (printf "models[%s].vllm.model is required: the weights' path inside vllm.modelVolume" $m.name) -}}
{{- end -}}
{{- else if eq $m.backend "kserve" -}}
{{- $ks := include "llm-gateway.kserve" (dict "root" $ "model" $m) | fromYaml -}}
{{- if not $ks.storageUri -}}
{{- fail (printf "models[%s].kserve.storageUri is required (pvc://CLAIM/PATH or hf://ORG/MODEL)" $m.name) -}}
{{- end -}}
{{- else if eq $m.backend "external" -}}
{{- if not $m.external -}}
{{- fail (printf "models[%s].external needs at least one backend {url: ...}" $m.name) -}}
{{- end -}}
{{- else if eq $m.backend "kubernetes" -}}
{{- if not (default dict $m.kubernetes).service -}}
{{- fail (printf "models[%s].kubernetes.service is required: the Service whose ready endpoints are the model's replicas" $m.name) -}}
{{- end -}}
{{- else -}}
{{- fail (printf "models[%s].backend must be vllm, kserve, external or kubernetes (got %v)" $m.name $m.backend) -}}
{{- end -}}
{{- $a := include "llm-gateway.autoscaling" (dict "root" $ "model" $m) | fromYaml -}}
{{- if $a.enabled -}}
{{- if not $m.cap -}}
{{- fail (printf "models[%s] autoscales but has no cap: the signal is the replicas needed at one replica's cap (`llm-gateway knee` measures it)" $m.name) -}}
{{- end -}}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) -}}
{{- fail (printf "models[%s] autoscaling.minReplicas (%d) exceeds maxReplicas (%d)" $m.name (int $a.minReplicas) (int $a.maxReplicas)) -}}
{{- end -}}
{{- if and (eq $m.backend "kserve") (not (include "llm-gateway.kserve" (dict "root" $ "model" $m) | fromYaml).discover) -}}
{{- fail (printf "models[%s] autoscales on KServe: set kserve.discover=true, so the gateway sees each predictor pod (and none while scaled to zero)" $m.name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if $v.tracing.enabled -}}
{{- if not (regexMatch "^https?://[^/@]+(/.*)?$" $v.tracing.endpoint) -}}
{{- fail "tracing.endpoint must be the collector's http(s) URL, e.g. http://otel-collector.observability.svc.cluster.local:4318/v1/traces, without credentials (export headers come from tracing.headers)" -}}
{{- end -}}
{{- $envs := dict -}}
{{- range $header, $_ := $v.tracing.headers -}}
{{- $env := include "llm-gateway.tracingHeaderEnv" $header -}}
{{- if hasKey $envs $env -}}
{{- fail (printf "tracing.headers %s and %s would share the env var %s" (get $envs $env) $header $env) -}}
{{- end -}}
{{- $_ := set $envs $env $header -}}
{{- end -}}
{{- end -}}
{{- range $p := $v.providers -}}
{{- $k := default dict $p.apiKey -}}
{{- if not (or $k.existingSecret $k.value) -}}
{{- fail (printf "providers[%s].apiKey needs existingSecret (and existingSecretKey) or value" $p.name) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The policy file (policies/config.py's schema), derived from the values; never holds a secret. */}}
{{- define "llm-gateway.policy" -}}
{{- $root := . -}}
{{- $v := .Values -}}
{{- $ns := .Release.Namespace -}}
{{- $p := deepCopy (default dict $v.policy) -}}
{{- $_ := set $p "listen" (dict "host" "0.0.0.0" "port" (int $v.gateway.port)) -}}
{{- $server := default dict $p.server -}}
{{- /* one value, drainSeconds, drives the rollout: serve (with /ready failing) that long after SIGTERM, then give
     streams what is left of the grace period, less a 15 s margin for the final flush */ -}}
{{- $drain := int $v.gateway.drainSeconds -}}
{{- $_ := set $server "drain_seconds" $drain -}}
{{- $shutdown := ternary (sub (int $v.gateway.terminationGracePeriodSeconds) (add $drain 15)) $v.gateway.shutdownTimeout (kindIs "invalid" $v.gateway.shutdownTimeout) -}}
{{- if lt (int $shutdown) 1 -}}{{- fail "gateway.terminationGracePeriodSeconds must exceed gateway.drainSeconds + 15 (the gateway's drain, then its streams, then a margin)" -}}{{- end -}}
{{- $_ := set $server "shutdown_timeout" $shutdown -}}
{{- $_ := set $p "server" $server -}}
{{- if eq (include "llm-gateway.storeKind" .) "redis" -}}
{{- $e := $v.redis.external -}}
{{- $store := dict "kind" "redis" -}}
{{- if and $v.redis.enabled $v.redis.sentinel.enabled -}}
{{- $rn := include "llm-gateway.redisName" . -}}
{{- $addresses := list -}}
{{- range $i := until (int $v.redis.sentinel.replicas) -}}{{- $addresses = append $addresses (printf "%s-%d.%s-headless.%s.svc.cluster.local:26379" $rn $i $rn $ns) -}}{{- end -}}
{{- $_ := set $store "sentinel" (dict "addresses" $addresses "master_name" $v.redis.sentinel.masterName) -}}
{{- else if $e.sentinel.addresses -}}
{{- $sentinel := dict "addresses" $e.sentinel.addresses "master_name" $e.sentinel.masterName -}}
{{- if $e.sentinel.existingSecret -}}{{- $_ := set $sentinel "password_env" "LLM_GATEWAY_REDIS_SENTINEL_PASSWORD" -}}{{- end -}}
{{- $_ := set $store "sentinel" $sentinel -}}
{{- $_ := set $store "tls" $e.tls -}}
{{- else if $e.cluster.nodes -}}
{{- $_ := set $store "cluster" (dict "nodes" $e.cluster.nodes) -}}
{{- $_ := set $store "tls" $e.tls -}}
{{- else -}}
{{- $_ := set $store "url" ($e.url | default (printf "redis://%s.%s.svc.cluster.local:6379/0" (include "llm-gateway.redisName" .) $ns)) -}}
{{- end -}}
{{- if include "llm-gateway.redisSecret" . -}}{{- $_ := set $store "password_env" "LLM_GATEWAY_REDIS_PASSWORD" -}}{{- end -}}
{{- $_ := set $p "store" $store -}}
{{- else -}}
{{- $_ := set $p "store" (dict "kind" "sqlite" "path" "/var/lib/llm-gateway/llm-gateway.db") -}}
{{- end -}}
{{- $batch := default dict $p.batch -}}
{{- $_ := set $batch "enabled" $v.gateway.batchFiles.enabled -}}
{{- $_ := set $batch "files_dir" "/var/lib/llm-gateway-files" -}}
{{- $_ := set $p "batch" $batch -}}
{{- $admin := default dict $p.admin -}}
{{- $_ := set $admin "jwt_secret_env" "LLM_GATEWAY_ADMIN_SECRET" -}}
{{- $_ := set $p "admin" $admin -}}
{{- $network := default dict $p.network -}}
{{- $_ := set $network "trusted_proxies" $v.gateway.trustedProxies -}}
{{- $_ := set $p "network" $network -}}
{{- $providers := list -}}
{{- range $pr := $v.providers -}}
{{- $entry := omit $pr "apiKey" -}}
{{- $_ := set $entry "api_key_env" (include "llm-gateway.providerEnv" $pr.name) -}}
{{- $providers = append $providers $entry -}}
{{- end -}}
{{- if $providers -}}{{- $_ := set $p "providers" $providers -}}{{- end -}}
{{- $models := list -}}
{{- range $m := $v.models -}}
{{- $entry := deepCopy (default dict $m.policy) -}}
{{- $_ := set $entry "name" $m.name -}}
{{- $backends := list -}}
{{- if eq $m.backend "vllm" -}}
{{- $vl := include "llm-gateway.vllm" (dict "root" $root "model" $m) | fromYaml -}}
{{- if $m.servedName -}}{{- $_ := set $entry "served_name" $m.servedName -}}{{- end -}}
{{- if (default dict $vl.autoscaling).enabled -}}
{{- /* one Deployment that KEDA scales: each of its pods, from its Service's EndpointSlices (watched) */ -}}
{{- $d := dict "kind" "kubernetes" "namespace" $ns "service" (include "llm-gateway.vllmScaledName" (dict "root" $root "model" $m)) "port" "http" "cap" (int $m.cap) -}}
{{- $_ := set $entry "discovery" $d -}}
{{- else -}}
{{- range $i := until (int $vl.replicas) -}}
{{- $name := include "llm-gateway.vllmName" (dict "root" $root "model" $m "index" $i) -}}
{{- $b := dict "name" $name "url" (printf "http://%s.%s.svc.cluster.local:%d" $name $ns (int $vl.port)) -}}
{{- if $m.cap -}}{{- $_ := set $b "cap" (int $m.cap) -}}{{- end -}}
{{- $backends = append $backends $b -}}
{{- end -}}
{{- end -}}
{{- else if eq $m.backend "kserve" -}}
{{- $ks := include "llm-gateway.kserve" (dict "root" $root "model" $m) | fromYaml -}}
{{- $isvc := include "llm-gateway.isvcName" (dict "root" $root "model" $m) -}}
{{- /* raw deployment: status.address.url is http://NAME-predictor.NAMESPACE.svc.cluster.local, one Service over every replica */ -}}
{{- if $ks.discover -}}
{{- /* each predictor pod, from the InferenceService and its predictor Service's EndpointSlices (watched) */ -}}
{{- $d := dict "kind" "kserve" "namespace" $ns "inference_service" $isvc -}}
{{- if eq $ks.runtime "huggingface" -}}{{- $_ := set $d "health_path" (printf "/v1/models/%s" $isvc) -}}{{- end -}}
{{- if $m.cap -}}{{- $_ := set $d "cap" (int $m.cap) -}}{{- end -}}
{{- $_ := set $entry "served_name" $isvc -}}
{{- $_ := set $entry "discovery" $d -}}
{{- else -}}
{{- $b := dict "name" $isvc "url" (printf "http://%s-predictor.%s.svc.cluster.local" $isvc $ns) "served_name" $isvc -}}
{{- if eq $ks.runtime "huggingface" -}}{{- $_ := set $b "health_path" (printf "/v1/models/%s" $isvc) -}}{{- end -}}
{{- if $m.cap -}}{{- $_ := set $b "cap" (mul (int $m.cap) (int $ks.replicas)) -}}{{- end -}}
{{- $backends = append $backends $b -}}
{{- end -}}
{{- else if eq $m.backend "kubernetes" -}}
{{- /* each ready endpoint of the Service, from its EndpointSlices (watched) */ -}}
{{- $k := default dict $m.kubernetes -}}
{{- $d := dict "kind" "kubernetes" "namespace" ($k.namespace | default $ns) "service" $k.service -}}
{{- if not (kindIs "invalid" $k.port) -}}{{- $_ := set $d "port" (ternary (int $k.port) $k.port (kindIs "float64" $k.port)) -}}{{- end -}}
{{- with $k.scheme -}}{{- $_ := set $d "scheme" . -}}{{- end -}}
{{- with $k.healthPath -}}{{- $_ := set $d "health_path" . -}}{{- end -}}
{{- if $m.cap -}}{{- $_ := set $d "cap" (int $m.cap) -}}{{- end -}}
{{- if $m.servedName -}}{{- $_ := set $entry "served_name" $m.servedName -}}{{- end -}}
{{- $_ := set $entry "discovery" $d -}}
{{- else -}}
{{- if $m.servedName -}}{{- $_ := set $entry "served_name" $m.servedName -}}{{- end -}}
{{- range $b := $m.external -}}
{{- $b = deepCopy $b -}}
{{- if and $m.cap (not (hasKey $b "cap")) -}}{{- $_ := set $b "cap" (int $m.cap) -}}{{- end -}}
{{- $backends = append $backends $b -}}
{{- end -}}
{{- end -}}
{{- if $backends -}}{{- $_ := set $entry "backends" $backends -}}{{- end -}}
{{- with $m.lora -}}
{{- $_ := set $entry "lora" (include "llm-gateway.policyLora" (dict "model" $m) | fromYaml) -}}
{{- end -}}
{{- if (include "llm-gateway.autoscaling" (dict "root" $root "model" $m) | fromYaml).enabled -}}
{{- $_ := set $entry "autoscaling" (include "llm-gateway.policyAutoscaling" (dict "root" $root "model" $m) | fromYaml) -}}
{{- end -}}
{{- $models = append $models $entry -}}
{{- end -}}
{{- $_ := set $p "models" $models -}}
{{- $t := $v.tracing -}}
{{- if $t.enabled -}}
{{- $tracing := dict "enabled" true "endpoint" $t.endpoint "sampling_ratio" $t.samplingRatio "service_name" $t.serviceName -}}
{{- if $t.contentModels -}}{{- $_ := set $tracing "content_models" $t.contentModels -}}{{- end -}}
{{- $headers := dict -}}
{{- range $header, $_ := $t.headers -}}{{- $_ := set $headers $header (include "llm-gateway.tracingHeaderEnv" $header) -}}{{- end -}}
{{- if $headers -}}{{- $_ := set $tracing "headers_from_env" $headers -}}{{- end -}}
{{- range $key, $field := dict "maxQueueSize" "max_queue_size" "maxExportBatchSize" "max_export_batch_size" "scheduleDelay" "schedule_delay" "exportTimeout" "export_timeout" -}}
{{- if not (kindIs "invalid" (get $t $key)) -}}{{- $_ := set $tracing $field (get $t $key) -}}{{- end -}}
{{- end -}}
{{- $_ := set $p "tracing" $tracing -}}
{{- end -}}
{{- toYaml $p -}}
{{- end -}}

{{/* Pod-selector peers of the gateway's pods, for NetworkPolicies */}}
{{- define "llm-gateway.gatewayPeer" -}}
- podSelector:
    matchLabels:
      {{- include "llm-gateway.selectorLabels" (dict "root" . "component" "gateway") | nindent 6 }}
{{- end -}}

{{/* non-empty when some model's replicas are discovered in the cluster: the gateway then reads the Kubernetes API */}}
{{- define "llm-gateway.discovers" -}}
{{- if ne (include "llm-gateway.discoveryReads" . | fromYaml | len) 0 -}}true{{- end -}}
{{- end -}}

{{/* What discovery reads, per namespace (YAML: NAMESPACE -> [resources]): the EndpointSlices of every namespace
     a `backend: kubernetes` Service lives in (and of the release namespace for autoscaled vLLM), and, with KServe discovery, the InferenceServices and the predictor
     Services' EndpointSlices of the release namespace. templates/rbac.yaml grants exactly that. */}}
{{- define "llm-gateway.discoveryReads" -}}
{{- $reads := dict -}}
{{- range $m := .Values.models -}}
{{- if eq $m.backend "vllm" -}}
{{- if (include "llm-gateway.autoscaling" (dict "root" $ "model" $m) | fromYaml).enabled -}}
{{- $_ := set $reads $.Release.Namespace (get $reads $.Release.Namespace | default list | concat (list "endpointslices") | uniq) -}}
{{- end -}}
{{- else if eq $m.backend "kserve" -}}
{{- $ks := include "llm-gateway.kserve" (dict "root" $ "model" $m) | fromYaml -}}
{{- if $ks.discover -}}
{{- $_ := set $reads $.Release.Namespace (get $reads $.Release.Namespace | default list | concat (list "endpointslices" "inferenceservices") | uniq) -}}
{{- end -}}
{{- else if eq $m.backend "kubernetes" -}}
{{- $ns := (default dict $m.kubernetes).namespace | default $.Release.Namespace -}}
{{- $_ := set $reads $ns (get $reads $ns | default list | concat (list "endpointslices") | uniq) -}}
{{- end -}}
{{- end -}}
{{- toYaml $reads -}}
{{- end -}}

{{/* A model's LoRA adapters in the policy (policies/config/lora.py): backend vllm reads them from the
     adapters' volume at lora.volume.mountPath, so a relative path is made absolute there */}}
{{- define "llm-gateway.loraMountPath" -}}
{{- (default dict .model.lora.volume).mountPath | default "/adapters" -}}
{{- end -}}

{{- define "llm-gateway.loraPath" -}}
{{- if and (eq .model.backend "vllm") (not (hasPrefix "/" .adapter.path)) -}}
{{- printf "%s/%s" (trimSuffix "/" (include "llm-gateway.loraMountPath" (dict "model" .model))) .adapter.path -}}
{{- else -}}
{{- .adapter.path -}}
{{- end -}}
{{- end -}}

{{- define "llm-gateway.policyLora" -}}
{{- $l := .model.lora -}}
{{- $adapters := list -}}
{{- range $a := $l.adapters -}}
{{- $e := dict "name" $a.name "path" (include "llm-gateway.loraPath" (dict "model" $.model "adapter" $a)) -}}
{{- with $a.aliases -}}{{- $_ := set $e "aliases" . -}}{{- end -}}
{{- with $a.servedName -}}{{- $_ := set $e "served_name" . -}}{{- end -}}
{{- with $a.limits -}}{{- $_ := set $e "limits" . -}}{{- end -}}
{{- $adapters = append $adapters $e -}}
{{- end -}}
{{- $out := dict "adapters" $adapters "max_loras" (int ($l.maxLoras | default 1)) -}}
{{- with $l.loadTimeout -}}{{- $_ := set $out "load_timeout" . -}}{{- end -}}
{{- with $l.refreshSeconds -}}{{- $_ := set $out "refresh_seconds" . -}}{{- end -}}
{{- toYaml $out -}}
{{- end -}}
