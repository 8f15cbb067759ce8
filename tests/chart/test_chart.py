"""The Helm chart: it lints, renders valid manifests for each example values file, derives a policy the gateway
accepts, keeps secrets out of ConfigMaps and NOTES, and refuses values that cannot work."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gateway.cli import main as gateway_cli
from tests.chart.render import CHART, NAMESPACE, RenderError, find, helm, policy_of, render, render_notes

EXAMPLES = ["minimal.yaml", "ha-redis.yaml", "ha-sentinel.yaml", "kserve.yaml", "providers.yaml",
            "kubernetes-discovery.yaml", "tracing.yaml", "autoscaling.yaml", "lora.yaml"]
SCHEMAS = Path(__file__).parent / "schemas"
CRD_SCHEMAS = {
    ("serving.kserve.io/v1beta1", "InferenceService"): "inferenceservice-serving.kserve.io-v1beta1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda.sh-v1alpha1.json",
}
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]


@cache
def rendered(values_file: str) -> tuple[dict, ...]:
    return tuple(render(values_file))


def strict(schema):
    """CRD schemas as `kubectl apply` treats them: declared properties only, unless preserve-unknown-fields."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@cache
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    schema = strict(json.loads((SCHEMAS / CRD_SCHEMAS[api_version, kind]).read_text()))
    schema["properties"]["metadata"] = {"type": "object"}  # the API server's ObjectMeta, checked for core kinds
    return jsonschema.Draft7Validator(schema)


def validate(doc: dict) -> None:
    key = (doc["apiVersion"], doc["kind"])
    if key in CRD_SCHEMAS:
        errors = sorted(crd_validator(*key).iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, f"{doc['kind']}/{doc['metadata']['name']}: " + "; ".join(
            f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors[:5])
        return
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def test_lint_strict():
    helm("lint", "--strict")
    for name in EXAMPLES:
        helm("lint", "--strict", "-f", str(Path(__file__).parent / "values" / name))


@pytest.mark.parametrize("values_file", EXAMPLES)
def test_every_manifest_validates(values_file):
    docs = rendered(values_file)
    assert docs
    for doc in docs:
        validate(doc)
    names = [(d["kind"], d["metadata"].get("namespace", NAMESPACE), d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), "two objects of one kind share a name in one namespace"


@pytest.mark.parametrize("values_file", EXAMPLES)
def test_rendered_policy_passes_check(values_file, tmp_path, capsys):
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy_of(list(rendered(values_file)))))
    assert gateway_cli(["check", str(path), "--no-resolve"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("values_file", EXAMPLES)
def test_backends_point_at_what_the_chart_runs(values_file):
    """Every derived backend URL names a Service this release renders (vLLM) or the predictor Service KServe
    makes for a rendered InferenceService; external ones are as given."""
    docs = rendered(values_file)
    services = {d["metadata"]["name"]: d for d in find(docs, "Service")}
    isvcs = {d["metadata"]["name"] for d in find(docs, "InferenceService")}
    for model in policy_of(list(docs))["models"]:
        for backend in model.get("backends", []):  # a model with `discovery` has none
            host = urlsplit(backend["url"]).hostname
            if not host.endswith(f".{NAMESPACE}.svc.cluster.local"):
                continue  # external
            name = host.split(".")[0]
            if name.endswith("-predictor"):
                assert name.removesuffix("-predictor") in isvcs
            else:
                port = urlsplit(backend["url"]).port
                assert port in [p["port"] for p in services[name]["spec"]["ports"]]


def test_minimal_release():
    docs = list(rendered("minimal.yaml"))
    (deploy,) = find(docs, "Deployment", "rel-llm-gateway")
    pod = deploy["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert "lifecycle" not in c  # no preStop sleep: the gateway drains by itself (server.drain_seconds)
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 600 + 15  # the longest stream plus the preStop sleep
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert re.fullmatch(r"[0-9a-f]{64}", pod["metadata"]["annotations"]["checksum/policy"])
    assert "podAntiAffinity" in pod["spec"]["affinity"]
    assert deploy["spec"]["strategy"]["type"] == "Recreate"  # one process owns the SQLite file
    assert find(docs, "PersistentVolumeClaim", "rel-llm-gateway-store")
    assert not find(docs, "StatefulSet") and not find(docs, "PodDisruptionBudget")
    policy = policy_of(docs)
    assert policy["store"] == {"kind": "sqlite", "path": "/var/lib/llm-gateway/llm-gateway.db"}
    assert policy["listen"] == {"host": "0.0.0.0", "port": 8080}
    assert policy["server"] == {"drain_seconds": 15, "shutdown_timeout": 600}  # from drainSeconds and the grace

    (vllm,) = find(docs, "Deployment", "rel-llm-gateway-vllm-qwen3-4b-0")
    (v,) = vllm["spec"]["template"]["spec"]["containers"]
    assert v["args"][0] == "/models/Qwen3-4B" and "--served-model-name=Qwen/Qwen3-4B" in v["args"]
    assert "--shutdown-timeout=600" in v["args"]
    assert v["readinessProbe"]["httpGet"]["path"] == "/health"
    assert v["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert vllm["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "models"


def test_policy_change_rolls_the_gateway():
    def checksum(docs):
        return find(docs, "Deployment", "rel-llm-gateway")[0]["spec"]["template"]["metadata"]["annotations"][
            "checksum/policy"]

    assert checksum(render("minimal.yaml")) != checksum(render("minimal.yaml", sets={"policy.timeouts.read": 60}))


def test_ha_release_with_redis():
    docs = list(rendered("ha-redis.yaml"))
    (deploy,) = find(docs, "Deployment", "rel-llm-gateway")
    assert deploy["spec"]["replicas"] == 3
    assert "requiredDuringSchedulingIgnoredDuringExecution" in deploy["spec"]["template"]["spec"]["affinity"][
        "podAntiAffinity"]
    (sts,) = find(docs, "StatefulSet", "rel-llm-gateway-redis")
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    (conf,) = find(docs, "ConfigMap", "rel-llm-gateway-redis")
    assert "appendonly yes" in conf["data"]["redis.conf"] and "requirepass" not in conf["data"]["redis.conf"]
    policy = policy_of(docs)
    assert policy["store"] == {"kind": "redis", "url": f"redis://rel-llm-gateway-redis.{NAMESPACE}.svc.cluster.local:6379/0",
                               "password_env": "LLM_GATEWAY_REDIS_PASSWORD"}
    env = {e["name"]: e for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["LLM_GATEWAY_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "rel-llm-gateway-redis", "key": "redis-password"}
    qwen = next(m for m in policy["models"] if m["name"] == "qwen3-4b")
    assert [b["cap"] for b in qwen["backends"]] == [32, 32] and qwen["routing"] == "session-affinity"
    assert len(find(docs, "Deployment")) == 1 + 3  # the gateway and one Deployment per vLLM replica
    assert find(docs, "PodDisruptionBudget") and find(docs, "Ingress")
    assert policy["network"]["trusted_proxies"] == ["10.42.0.0/16"]
    assert {d["metadata"]["name"] for d in find(docs, "ServiceMonitor")} == {
        "rel-llm-gateway-gateway", "rel-llm-gateway-vllm"}


def test_kserve_release():
    docs = list(rendered("kserve.yaml"))
    isvcs = {d["metadata"]["name"]: d for d in find(docs, "InferenceService")}
    assert set(isvcs) == {"rel-llm-gateway-qwen3-4b", "rel-llm-gateway-mistral-7b"}
    hf = isvcs["rel-llm-gateway-qwen3-4b"]
    assert hf["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"
    model = hf["spec"]["predictor"]["model"]
    assert model["modelFormat"]["name"] == "huggingface" and "--backend=vllm" in model["args"]
    assert model["storageUri"] == "pvc://models/Qwen3-4B"
    assert hf["spec"]["predictor"]["minReplicas"] == hf["spec"]["predictor"]["maxReplicas"] == 2
    backends = {m["name"]: m["backends"] for m in policy_of(docs)["models"]}
    assert backends["qwen3-4b"] == [{
        "name": "rel-llm-gateway-qwen3-4b", "served_name": "rel-llm-gateway-qwen3-4b", "cap": 64,
        "url": f"http://rel-llm-gateway-qwen3-4b-predictor.{NAMESPACE}.svc.cluster.local",
        "health_path": "/v1/models/rel-llm-gateway-qwen3-4b"}]
    assert "health_path" not in backends["mistral-7b"][0]  # kserve-vllmserver serves vLLM's /health
    assert isvcs["rel-llm-gateway-mistral-7b"]["spec"]["predictor"]["model"]["modelFormat"]["name"] == "vLLM"
    (deploy,) = find(docs, "Deployment")  # only the gateway: KServe runs the model servers
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["LLM_GATEWAY_ADMIN_SECRET"] == {"name": "llm-gateway-admin", "key": "jwt"}
    assert env["LLM_GATEWAY_REDIS_PASSWORD"] == {"name": "platform-redis", "key": "password"}
    assert not find(docs, "Secret") and not find(docs, "StatefulSet")  # every secret came from existing Secrets


def test_network_policies():
    docs = list(rendered("providers.yaml"))
    policies = {d["metadata"]["name"]: d["spec"] for d in find(docs, "NetworkPolicy")}
    assert set(policies) == {"rel-llm-gateway-gateway", "rel-llm-gateway-vllm", "rel-llm-gateway-redis"}
    gateway_peer = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "llm-gateway",
                                                    "app.kubernetes.io/instance": "rel",
                                                    "app.kubernetes.io/component": "gateway"}}}
    vllm = policies["rel-llm-gateway-vllm"]
    assert vllm["ingress"][0]["from"][0] == gateway_peer and vllm["egress"] == []
    assert [p["port"] for p in vllm["ingress"][0]["ports"]] == [8000]
    redis = policies["rel-llm-gateway-redis"]
    assert redis["ingress"] == [{"from": [gateway_peer], "ports": [{"port": 6379, "protocol": "TCP"}]}]
    egress = policies["rel-llm-gateway-gateway"]["egress"]
    ports = [sorted(p["port"] for p in rule["ports"]) for rule in egress]
    assert ports == [[53, 53], [8000], [6379], [443], [443]]  # DNS, vLLM, Redis, the external backend, providers
    provider_rule = egress[-1]["to"][0]["ipBlock"]
    assert provider_rule["cidr"] == "0.0.0.0/0" and "10.0.0.0/8" in provider_rule["except"]
    # without providers there is no public egress at all
    egress = find(list(rendered("minimal.yaml")), "NetworkPolicy", "rel-llm-gateway-gateway")[0]["spec"]["egress"]
    assert not any("ipBlock" in peer for rule in egress for peer in rule["to"])


def test_provider_keys_reach_the_env_vars_the_policy_names():
    docs = list(rendered("providers.yaml"))
    (deploy,) = find(docs, "Deployment", "rel-llm-gateway")
    env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef")
           for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    providers = {p["name"]: p["api_key_env"] for p in policy_of(docs)["providers"]}
    assert env[providers["openai"]] == {"name": "openai-key", "key": "api-key"}
    assert env[providers["together"]] == {"name": "rel-llm-gateway", "key": "provider-together"}
    assert env["LLM_GATEWAY_REDIS_PASSWORD"] == {"name": "redis-auth", "key": "redis-password"}
    assert find(docs, "HorizontalPodAutoscaler") and "replicas" not in deploy["spec"]


def gateway_egress(docs: list[dict]) -> list[dict]:
    return find(docs, "NetworkPolicy", "rel-llm-gateway-gateway")[0]["spec"]["egress"]


def test_tracing_to_the_collector_in_the_cluster(tmp_path):
    docs = list(rendered("tracing.yaml"))
    tracing = policy_of(docs)["tracing"]
    assert tracing == {
        "enabled": True, "endpoint": "http://otel-collector.observability.svc.cluster.local:4318/v1/traces",
        "sampling_ratio": 0.25, "service_name": "llm-gateway", "content_models": ["qwen3-4b"],
        "max_queue_size": 4096,
        "headers_from_env": {"authorization": "LLM_GATEWAY_OTLP_HEADER_AUTHORIZATION",
                             "x-scope-orgid": "LLM_GATEWAY_OTLP_HEADER_X_SCOPE_ORGID"}}
    # each header's value reaches the env var the policy names, from the Secret, never as a value
    (deploy,) = find(docs, "Deployment", "rel-llm-gateway")
    env = {e["name"]: e for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["LLM_GATEWAY_OTLP_HEADER_AUTHORIZATION"] == {
        "name": "LLM_GATEWAY_OTLP_HEADER_AUTHORIZATION",
        "valueFrom": {"secretKeyRef": {"name": "otel-auth", "key": "bearer"}}}
    assert env["LLM_GATEWAY_OTLP_HEADER_X_SCOPE_ORGID"]["valueFrom"]["secretKeyRef"] == {
        "name": "otel-auth", "key": "tenant"}
    # egress to the collector: the peers given, on the endpoint's port, and nowhere else on that port
    rules = [r for r in gateway_egress(docs) if 4318 in [p["port"] for p in r["ports"]]]
    assert rules == [{"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}},
                              "podSelector": {"matchLabels": {"app.kubernetes.io/name": "opentelemetry-collector"}}}],
                      "ports": [{"port": 4318, "protocol": "TCP"}]}]
    # no peers given: the private ranges, on the port of an https URL without one
    anywhere = tmp_path / "values.yaml"
    anywhere.write_text(yaml.safe_dump({"networkPolicy": {"collectorTo": []}}))
    docs = render("tracing.yaml", str(anywhere),
                  sets={"tracing.endpoint": "https://collector.observability.svc/v1/traces"})
    (rule,) = [r for r in gateway_egress(docs) if 443 in [p["port"] for p in r["ports"]]]
    assert [peer["ipBlock"]["cidr"] for peer in rule["to"]] == ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"]
    # tracing off (the default): no tracing section, no header env vars, no collector rule
    docs = list(rendered("minimal.yaml"))
    assert "tracing" not in policy_of(docs)
    env = find(docs, "Deployment", "rel-llm-gateway")[0]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert not [e for e in env if e["name"].startswith("LLM_GATEWAY_OTLP_HEADER_")]
    assert not [r for r in gateway_egress(docs) if 4318 in [p["port"] for p in r["ports"]]]


@pytest.mark.parametrize("sets, message", [
    ({"tracing.endpoint": ""}, "tracing.endpoint must be the collector's http(s) URL"),
    ({"tracing.endpoint": "http://user:s3cret@collector.observability.svc:4318/v1/traces"},
     "without credentials"),
    ({"tracing.headers.authorization.value": "Bearer s3cret"}, "Additional property value is not allowed"),
    ({"policy.tracing.enabled": True}, "policy.tracing is derived by the chart"),
])
def test_tracing_values_that_cannot_work_fail_the_render(sets, message):
    with pytest.raises(RenderError, match=re.escape(message)):
        render("tracing.yaml", sets=sets)


SECRETS = {
    "admin.jwtSecret": "ADMIN-jwt-secret-value-0123456789abcdef",
    "providers[1].apiKey.value": "tg-test-provider-key-0123456789",
}


def test_secrets_only_in_secret_objects(tmp_path):
    docs = render("providers.yaml", sets=SECRETS)
    secret_docs = find(docs, "Secret")
    for doc in docs:
        text = yaml.safe_dump(doc)
        if doc["kind"] == "Secret":
            continue
        for value in SECRETS.values():
            assert value not in text, f"a secret leaked into {doc['kind']}/{doc['metadata']['name']}"
    (gateway_secret,) = [d for d in secret_docs if d["metadata"]["name"] == "rel-llm-gateway"]
    import base64

    decoded = {k: base64.b64decode(v).decode() for k, v in gateway_secret["data"].items()}
    assert decoded == {"admin-jwt-secret": SECRETS["admin.jwtSecret"], "provider-together": SECRETS[
        "providers[1].apiKey.value"]}
    notes = render_notes(tmp_path, "providers.yaml", sets=SECRETS)
    assert "kubectl" in notes and not any(value in notes for value in SECRETS.values())
    # the generated ones too: the Redis password and a generated admin secret stay in their Secrets
    docs = render("ha-redis.yaml")
    generated = [base64.b64decode(v).decode() for d in find(docs, "Secret") for v in d["data"].values()]
    assert len(generated) == 2
    for doc in docs:
        if doc["kind"] != "Secret":
            assert not any(value in yaml.safe_dump(doc) for value in generated)


@pytest.mark.parametrize("sets, message", [
    ({"gateway.replicas": 3}, "gateway.replicas is 3 but the store is the embedded SQLite file"),
    ({"gateway.autoscaling.enabled": True}, "with autoscaling but the store is the embedded SQLite file"),
    ({"redis.external.url": "redis://:hunter2@redis:6379/0", "gateway.replicas": 1},
     "redis.external.url carries a password"),
    ({"models[0].backend": "vllm", "models[0].vllm.model": ""}, "vllm.model is required"),
    ({"policy.store.kind": "redis"}, "policy.store is derived by the chart"),
])
def test_values_that_cannot_work_fail_the_render(sets, message):
    with pytest.raises(RenderError, match=re.escape(message)):
        render("minimal.yaml", sets=sets)


def test_values_schema_refuses_unknown_backend_kind():
    with pytest.raises(RenderError, match="backend"):
        render("minimal.yaml", sets={"models[0].backend": "triton"})


def test_drain_settings_follow_one_value():
    policy = policy_of(render("minimal.yaml", sets={"gateway.drainSeconds": 20}))
    assert policy["server"] == {"drain_seconds": 20, "shutdown_timeout": 595}
    policy = policy_of(render("minimal.yaml", sets={"gateway.drainSeconds": 20, "gateway.shutdownTimeout": 300}))
    assert policy["server"] == {"drain_seconds": 20, "shutdown_timeout": 300}
    with pytest.raises(RenderError, match="must exceed"):
        render("minimal.yaml", sets={"gateway.drainSeconds": 620})


# --- the dashboard ---

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32-cpu"


def known_metric_names() -> set[str]:
    """Every sample name the gateway and vLLM 0.32 expose: the gateway's from its registry, vLLM's from a
    real /metrics capture."""
    from policies.metrics import GatewayMetrics
    from policies.scaling import ScalingSignal

    names = set()
    suffixes = {"counter": ["_total", "_created"], "histogram": ["_bucket", "_sum", "_count", "_created"],
                "gauge": [""], "summary": ["", "_sum", "_count", "_created"]}
    metrics = GatewayMetrics()
    ScalingSignal(metrics.registry)  # its gauges join the gateway's registry
    for family in metrics.registry.collect():
        names |= {family.name + s for s in suffixes.get(family.type, [""])}
    for line in (FIXTURES / "metrics.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    names |= set((FIXTURES / "metric_names.txt").read_text().split())
    return names


def test_dashboard_queries_only_metrics_that_exist():
    docs = list(rendered("minimal.yaml"))
    (cm,) = find(docs, "ConfigMap", "rel-llm-gateway-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["llm-gateway.json"])
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) > 20
    known = known_metric_names()
    used = {m for e in exprs for m in re.findall(r"\b(?:llm_gateway_[a-z0-9_]+|vllm:[a-z0-9_]+)", e)}
    assert not used - known, f"the dashboard queries metrics nobody exposes: {sorted(used - known)}"
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ["requests", "time to first token", "inter-token", "tokens/s", "queue depth", "queue wait",
                  "in flight vs cap", "owned vs rented", "rented cost", "own or rent", "errors", "replicas needed"]:
        assert topic in titles, topic
    assert {m for m in used if m.startswith("vllm:")} and {m for m in used if m.startswith("llm_gateway_")}
    assert CHART.joinpath("files", "dashboard.json").read_text() == cm["data"]["llm-gateway.json"].rstrip("\n") + "\n"


@pytest.mark.parametrize("external, store_key", [
    ({"sentinel": {"addresses": ["redis-sentinel.data:26379"], "masterName": "gw",
                   "existingSecret": "sentinel-auth"}}, "sentinel"),
    ({"cluster": {"nodes": ["redis-0.data:6379", "redis-1.data:6379"]}, "tls": True}, "cluster"),
])
def test_external_sentinel_or_cluster(tmp_path, external, store_key):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        "gateway": {"replicas": 3, "batchFiles": {"persistence": {"accessModes": ["ReadWriteMany"]}}},
        "redis": {"external": {**external, "existingSecret": "redis-auth", "cidrs": ["10.30.0.0/24"]}},
        "models": [{"name": "m", "backend": "external", "external": [{"url": "http://10.20.0.11:8000"}]}],
    }))
    docs = render(str(values))
    for doc in docs:
        validate(doc)
    store = policy_of(docs)["store"]
    assert "url" not in store and store["password_env"] == "LLM_GATEWAY_REDIS_PASSWORD"
    env = {e["name"]: e for e in find(docs, "Deployment", "rel-llm-gateway")[0]["spec"]["template"]["spec"]
           ["containers"][0]["env"]}
    assert env["LLM_GATEWAY_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "redis-auth"
    egress = find(docs, "NetworkPolicy", "rel-llm-gateway-gateway")[0]["spec"]["egress"]
    redis_rule = next(r for r in egress if r["to"][0].get("ipBlock", {}).get("cidr") == "10.30.0.0/24")
    ports = sorted(p["port"] for p in redis_rule["ports"])
    if store_key == "sentinel":
        assert store["sentinel"] == {"addresses": ["redis-sentinel.data:26379"], "master_name": "gw",
                                     "password_env": "LLM_GATEWAY_REDIS_SENTINEL_PASSWORD"}
        assert env["LLM_GATEWAY_REDIS_SENTINEL_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "sentinel-auth"
        assert ports == [6379, 26379]  # the sentinels' port as well as the servers'
    else:
        assert store["cluster"] == {"nodes": ["redis-0.data:6379", "redis-1.data:6379"]} and store["tls"] is True
        assert ports == [6379]
    assert not find(docs, "StatefulSet")  # nothing bundled
    # a secret is only ever named (env var, Secret key), never carried
    text = json.dumps(docs).lower()
    for named in ("password_env", "redis_password", "sentinel_password", "redis-password", "sentinel-password"):
        text = text.replace(named, "")
    assert "password" not in text


def test_two_ways_to_reach_redis_fail_the_render(tmp_path):
    with pytest.raises(RenderError, match="choose one Redis"):
        render("minimal.yaml", sets={"redis.enabled": True, "redis.external.cluster.nodes[0]": "r:6379"})


def test_bundled_sentinel():
    docs = list(rendered("ha-sentinel.yaml"))
    (redis,) = find(docs, "StatefulSet", "rel-llm-gateway-redis")
    pod = redis["spec"]["template"]["spec"]
    assert redis["spec"]["replicas"] == 3 and redis["spec"]["serviceName"] == "rel-llm-gateway-redis-headless"
    assert [c["name"] for c in pod["containers"]] == ["redis", "sentinel"]
    assert find(docs, "Service", "rel-llm-gateway-redis-headless")[0]["spec"]["clusterIP"] == "None"
    store = policy_of(docs)["store"]
    assert store["sentinel"]["addresses"] == [
        f"rel-llm-gateway-redis-{i}.rel-llm-gateway-redis-headless.{NAMESPACE}.svc.cluster.local:26379"
        for i in range(3)]
    assert "url" not in store and store["password_env"] == "LLM_GATEWAY_REDIS_PASSWORD"
    (config,) = [d for d in find(docs, "ConfigMap", "rel-llm-gateway-redis")]
    assert "sentinel monitor mymaster $primary 6379 2" in config["data"]["start-sentinel.sh"]  # quorum: majority
    assert "sentinel down-after-milliseconds mymaster 3000" in config["data"]["start-sentinel.sh"]
    # the sentinel port is open: gateway -> Redis pods, and among the Redis pods (replication, gossip)
    policies = {d["metadata"]["name"]: d["spec"] for d in find(docs, "NetworkPolicy")}
    gateway_ports = [sorted(p["port"] for p in rule["ports"]) for rule in policies["rel-llm-gateway-gateway"]["egress"]]
    assert [6379, 26379] in gateway_ports
    redis_policy = policies["rel-llm-gateway-redis"]
    assert [sorted(p["port"] for p in rule["ports"]) for rule in redis_policy["ingress"]] == [[6379, 26379]] * 2
    # the password reaches both containers from the Secret, never as a value in a manifest
    for container in pod["containers"]:
        env = {e["name"]: e for e in container["env"]}
        assert "secretKeyRef" in env["REDIS_PASSWORD"]["valueFrom"]


def test_kserve_discovery_grants_only_reads_of_endpointslices_and_inferenceservices(tmp_path, capsys):
    plain = render("kserve.yaml")
    assert not find(plain, "Role") and not find(plain, "RoleBinding")  # no discovery: no API access at all
    (deploy,) = find(plain, "Deployment")
    assert deploy["spec"]["template"]["spec"]["automountServiceAccountToken"] is False

    docs = render("kserve.yaml", sets={"kserveDefaults.discover": True})
    for doc in docs:
        validate(doc)
    (role,) = find(docs, "Role")
    assert role["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["serving.kserve.io"], "resources": ["inferenceservices"], "verbs": ["get", "list", "watch"]},
    ]
    assert not find(docs, "ClusterRole") and not find(docs, "ClusterRoleBinding")
    (binding,) = find(docs, "RoleBinding")
    (account,) = find(docs, "ServiceAccount")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": NAMESPACE}]
    (deploy,) = find(docs, "Deployment")
    assert deploy["spec"]["template"]["spec"]["automountServiceAccountToken"] is True  # in-cluster config
    models = {m["name"]: m for m in policy_of(docs)["models"]}
    assert models["qwen3-4b"]["discovery"] == {
        "kind": "kserve", "namespace": NAMESPACE, "inference_service": "rel-llm-gateway-qwen3-4b", "cap": 32,
        "health_path": "/v1/models/rel-llm-gateway-qwen3-4b"}
    assert "backends" not in models["qwen3-4b"]
    gateway_np = [n for n in find(docs, "NetworkPolicy") if "gateway" in n["metadata"]["name"]][0]
    api_rule = [r for r in gateway_np["spec"]["egress"] if {"port": 6443, "protocol": "TCP"} in r.get("ports", [])]
    assert api_rule, "the gateway may not reach the Kubernetes API"
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy_of(docs)))
    assert gateway_cli(["check", str(path), "--no-resolve"]) == 0, capsys.readouterr().err


def discovery_rbac(docs: list[dict]) -> dict[str, list[dict]]:
    """Namespace -> the rules its discovery Role grants, after checking each Role is bound to the gateway's
    service account (in the release namespace) and nothing cluster-wide is granted."""
    assert not find(docs, "ClusterRole") and not find(docs, "ClusterRoleBinding")
    (account,) = find(docs, "ServiceAccount")
    roles = {r["metadata"]["namespace"]: r for r in find(docs, "Role")}
    bindings = {b["metadata"]["namespace"]: b for b in find(docs, "RoleBinding")}
    assert set(roles) == set(bindings)
    for namespace, binding in bindings.items():
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": roles[namespace]["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                        "namespace": NAMESPACE}]
    return {namespace: role["rules"] for namespace, role in roles.items()}


ENDPOINTSLICES = {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
INFERENCESERVICES = {"apiGroups": ["serving.kserve.io"], "resources": ["inferenceservices"],
                     "verbs": ["get", "list", "watch"]}


def test_kubernetes_discovery_reads_endpointslices_where_the_services_are(tmp_path, capsys):
    docs = list(rendered("kubernetes-discovery.yaml"))
    # only EndpointSlices, only in the namespaces the discovered Services live in: no InferenceServices
    assert discovery_rbac(docs) == {NAMESPACE: [ENDPOINTSLICES], "inference": [ENDPOINTSLICES]}
    (deploy,) = find(docs, "Deployment")  # the gateway alone: the replicas run elsewhere
    assert deploy["spec"]["template"]["spec"]["automountServiceAccountToken"] is True  # in-cluster config
    models = {m["name"]: m for m in policy_of(docs)["models"]}
    assert models["qwen3-4b"] == {"name": "qwen3-4b", "discovery": {
        "kind": "kubernetes", "namespace": NAMESPACE, "service": "vllm-qwen", "port": "http", "cap": 32}}
    assert models["llama-8b"] == {"name": "llama-8b", "served_name": "meta-llama/Llama-3.1-8B-Instruct",
                                  "discovery": {"kind": "kubernetes", "namespace": "inference",
                                                "service": "vllm-llama", "port": 8000, "cap": 24,
                                                "health_path": "/health"}}
    egress = find(docs, "NetworkPolicy", "rel-llm-gateway-gateway")[0]["spec"]["egress"]
    to_pods = [r for r in egress if "namespaceSelector" in r["to"][0] and "kube-dns" not in json.dumps(r)]
    assert to_pods == [
        {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}},
                 "podSelector": {}}], "ports": [{"port": "http", "protocol": "TCP"}]},
        {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "inference"}},
                 "podSelector": {"matchLabels": {"app": "vllm-llama"}}}], "ports": [{"port": 8000, "protocol": "TCP"}]},
    ]
    assert any({"port": 6443, "protocol": "TCP"} in r.get("ports", []) for r in egress), "no egress to the API"
    # the policy the gateway would load names real Services: `check` accepts it
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy_of(docs)))
    assert gateway_cli(["check", str(path), "--no-resolve"]) == 0, capsys.readouterr().err


def test_kserve_and_kubernetes_discovery_share_one_role_per_namespace(tmp_path):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        "kserveDefaults": {"discover": True},
        "models": [
            {"name": "qwen3-4b", "backend": "kserve", "kserve": {"storageUri": "pvc://models/Qwen3-4B"}},
            {"name": "local", "backend": "kubernetes", "kubernetes": {"service": "vllm-local"}},
            {"name": "remote", "backend": "kubernetes", "kubernetes": {"service": "vllm", "namespace": "gpu"}},
        ],
    }))
    docs = render(str(values))
    for doc in docs:
        validate(doc)
    assert discovery_rbac(docs) == {NAMESPACE: [ENDPOINTSLICES, INFERENCESERVICES], "gpu": [ENDPOINTSLICES]}
    egress = find(docs, "NetworkPolicy", "rel-llm-gateway-gateway")[0]["spec"]["egress"]
    gpu = {"kubernetes.io/metadata.name": "gpu"}
    (gpu_rule,) = [r for r in egress if r["to"][0].get("namespaceSelector", {}).get("matchLabels") == gpu]
    assert "ports" not in gpu_rule  # no port named: the Service's pods on any port, in that namespace only


def test_kubernetes_backend_needs_a_service():
    with pytest.raises(RenderError, match=re.escape("models[m].kubernetes.service is required")):
        render("minimal.yaml", sets={"models[0].name": "m", "models[0].backend": "kubernetes"})
    with pytest.raises(RenderError, match="service"):  # the values schema: a Service's name is a DNS label
        render("minimal.yaml", sets={"models[0].backend": "kubernetes", "models[0].kubernetes.service": "Not_A_Name"})


def test_keda_scales_vllm_and_kserve_on_the_replicas_needed_signal():
    """With autoscaling on, one ScaledObject per scaled model reads `needed` from the gateway's GET /scaling; the
    vLLM model runs as one Deployment (KEDA owns its count) whose pods the gateway discovers, the KServe one
    leaves its HPA to KEDA; the policy carries the signal's settings; KEDA (and the ingress) reach the gateway."""
    docs = list(rendered("autoscaling.yaml"))
    scaled = {d["metadata"]["name"]: d["spec"] for d in find(docs, "ScaledObject")}
    assert set(scaled) == {"rel-llm-gateway-vllm-qwen-qwen3-4b", "rel-llm-gateway-mistral-7b-predictor"}
    vllm = scaled["rel-llm-gateway-vllm-qwen-qwen3-4b"]
    assert vllm["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                      "name": "rel-llm-gateway-vllm-qwen-qwen3-4b"}
    assert (vllm["minReplicaCount"], vllm["maxReplicaCount"], vllm["cooldownPeriod"]) == (0, 3, 600)
    (trigger,) = vllm["triggers"]
    assert trigger["type"] == "metrics-api" and trigger["metadata"] == {
        "url": f"http://rel-llm-gateway.{NAMESPACE}.svc.cluster.local:80/scaling?model=Qwen%2FQwen3-4B",
        "format": "json", "valueLocation": "needed", "targetValue": "1", "activationTargetValue": "0"}
    (deploy,) = find(docs, "Deployment", "rel-llm-gateway-vllm-qwen-qwen3-4b")
    assert "replicas" not in deploy["spec"]  # KEDA's to set; a helm upgrade must not reset it
    assert find(docs, "Service", "rel-llm-gateway-vllm-qwen-qwen3-4b")
    assert len(find(docs, "Deployment", "rel-llm-gateway-vllm-llama-3b-1")) == 1  # not scaled: as before
    models = {m["name"]: m for m in policy_of(docs)["models"]}
    qwen = models["Qwen/Qwen3-4B"]
    assert "backends" not in qwen and qwen["discovery"] == {
        "kind": "kubernetes", "namespace": NAMESPACE, "service": "rel-llm-gateway-vllm-qwen-qwen3-4b",
        "port": "http", "cap": 64}
    assert qwen["autoscaling"] == {"headroom": 0.1, "smoothing_seconds": 60, "cold_start_wait": 240, "replica_cap": 64}
    assert models["mistral-7b"]["autoscaling"]["replica_cap"] == 32 and "autoscaling" not in models["llama-3b"]

    (isvc,) = find(docs, "InferenceService")
    assert isvc["metadata"]["annotations"]["serving.kserve.io/autoscalerClass"] == "external"
    assert (isvc["spec"]["predictor"]["minReplicas"], isvc["spec"]["predictor"]["maxReplicas"]) == (1, 2)
    (role,) = find(docs, "Role")  # the scaled vLLM's EndpointSlices and the InferenceService, in one namespace
    assert role["metadata"]["namespace"] == NAMESPACE
    (gateway_np,) = find(docs, "NetworkPolicy", "rel-llm-gateway-gateway")
    allowed = gateway_np["spec"]["ingress"][0]["from"]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}}} in allowed


@pytest.mark.parametrize("values_file", [f for f in EXAMPLES if f != "autoscaling.yaml"])
def test_without_autoscaling_no_scaled_object(values_file):
    docs = rendered(values_file)
    assert not find(list(docs), "ScaledObject")
    assert all("autoscaling" not in m for m in policy_of(list(docs))["models"])


@pytest.mark.parametrize(("sets", "message"), [
    ({"models[1].kserve.discover": False}, "set kserve.discover=true"),
    ({"models[0].vllm.autoscaling.minReplicas": 5}, "minReplicas (5) exceeds maxReplicas (3)"),
])
def test_autoscaling_values_that_cannot_work_fail_the_render(sets, message):
    with pytest.raises(RenderError, match=re.escape(message)):
        render("autoscaling.yaml", sets=sets)


def test_autoscaling_without_a_cap_fails_the_render(tmp_path):
    values = yaml.safe_load((Path(__file__).parent / "values" / "autoscaling.yaml").read_text())
    del values["models"][0]["cap"]
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    with pytest.raises(RenderError, match=re.escape("models[Qwen/Qwen3-4B] autoscales but has no cap")):
        render(str(path))


def test_batch_files_live_on_a_volume_every_replica_mounts():
    docs = list(rendered("minimal.yaml"))
    (pvc,) = find(docs, "PersistentVolumeClaim", "rel-llm-gateway-batch-files")
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    (deploy,) = find(docs, "Deployment", "rel-llm-gateway")
    pod = deploy["spec"]["template"]["spec"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "batch-files"]
    assert mount["mountPath"] == policy_of(docs)["batch"]["files_dir"] == "/var/lib/llm-gateway-files"
    assert {"name": "batch-files", "persistentVolumeClaim": {"claimName": "rel-llm-gateway-batch-files"}} in \
        pod["volumes"]
    ha = list(rendered("ha-redis.yaml"))
    (shared,) = find(ha, "PersistentVolumeClaim", "rel-llm-gateway-batch-files")
    assert shared["spec"]["accessModes"] == ["ReadWriteMany"] and shared["spec"]["storageClassName"] == "nfs"
    off = render("minimal.yaml", sets={"gateway.batchFiles.enabled": False})
    assert not find(off, "PersistentVolumeClaim", "rel-llm-gateway-batch-files")
    assert policy_of(off)["batch"]["enabled"] is False
    with pytest.raises(RenderError, match="ReadWriteMany"):
        render("minimal.yaml", sets={"gateway.replicas": 2, "redis.enabled": True})


def test_lora_adapters_reach_vllm_and_the_policy():
    """A model's `lora` values: vLLM runs with LoRA enabled and reads the adapters from their volume (a PVC, or an
    emptyDir an init step fills), loaded by the gateway at run time or by vLLM at start; the policy lists each
    adapter with the path vLLM sees."""
    docs = list(rendered("lora.yaml"))
    models = {m["name"]: m for m in policy_of(docs)["models"]}
    lora = models["qwen3-4b"]["lora"]
    assert lora["max_loras"] == 2
    assert [(a["name"], a["path"]) for a in lora["adapters"]] == [
        ("support-bot", "/adapters/support-bot"), ("sql-writer", "/adapters/sql-writer"),
        ("summarizer", "/adapters/shared/summarizer")]
    assert lora["adapters"][0]["aliases"] == ["support-bot-latest"]
    assert lora["adapters"][0]["limits"] == {"requests_per_minute": 600}
    for i in (0, 1):
        (deploy,) = find(docs, "Deployment", f"rel-llm-gateway-vllm-qwen3-4b-{i}")
        pod = deploy["spec"]["template"]["spec"]
        (v,) = pod["containers"]
        assert {"--enable-lora", "--max-loras=2", "--max-lora-rank=16"} <= set(v["args"])
        assert "--lora-modules" not in v["args"]
        assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in v["env"]
        mount = next(m for m in v["volumeMounts"] if m["name"] == "lora-adapters")
        assert mount == {"name": "lora-adapters", "mountPath": "/adapters", "readOnly": True}
        volume = next(vol for vol in pod["volumes"] if vol["name"] == "lora-adapters")
        assert volume["persistentVolumeClaim"] == {"claimName": "adapters", "readOnly": True}
        assert "initContainers" not in pod

    (deploy,) = find(docs, "Deployment", "rel-llm-gateway-vllm-llama-8b-0")
    pod = deploy["spec"]["template"]["spec"]
    (v,) = pod["containers"]
    at = v["args"].index("--lora-modules")
    assert v["args"][at + 1] == "llama-legal=/adapters/legal" and "--max-loras=1" in v["args"]
    assert not any(e["name"] == "VLLM_ALLOW_RUNTIME_LORA_UPDATING" for e in v["env"])
    (init,) = pod["initContainers"]
    assert init["volumeMounts"] == [{"name": "lora-adapters", "mountPath": "/adapters"}]
    assert next(vol for vol in pod["volumes"] if vol["name"] == "lora-adapters") == {"name": "lora-adapters",
                                                                                    "emptyDir": {}}
    assert models["llama-8b"]["lora"]["adapters"] == [{"name": "llama-legal", "path": "/adapters/legal"}]


def test_lora_values_that_cannot_work_fail_the_render(tmp_path):
    values = yaml.safe_load((Path(__file__).parent / "values" / "lora.yaml").read_text())
    values["models"][0]["lora"]["adapters"][0]["rank"] = 8  # not a setting of the chart
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    with pytest.raises(RenderError, match="rank"):
        render(str(path))
