"""The deployment files, checked by the tools that read them, without a cluster, a Docker daemon or a
running proxy:

- `kubectl kustomize deploy/kubernetes` renders every object;
- built-in objects (Deployment, Service, ConfigMap, RBAC) pass the official Kubernetes schemas in
  strict mode (`kubernetes-validate`, unknown fields rejected). `kubectl apply --dry-run=client`
  cannot do this offline: even with `--validate=false` it asks an API server for discovery, so it
  runs here only when one answers;
- the Gateway API objects (InferencePool, HTTPRoute), which no offline schema knows, are checked
  against the fields their v1 APIs define (required fields present, no unknown ones);
- `hadolint` accepts the Dockerfile;
- Debian's nginx accepts deploy/nginx (when installed).

The checks that only read the files are tests/unit/test_deploy_files.py.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from support import ROOT

from webapp.ops.waitress_settings import threads_needed

KUBERNETES = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.32.0"  # the oldest version still supported upstream when this was written
BIN = Path(sys.executable).parent
GATEWAY_KINDS = {"InferencePool", "HTTPRoute"}  # custom resources: no offline schema knows them


def tool(name: str) -> str:
    """A command from the venv (requirements-dev.txt pins it) or else from PATH; skip without it."""
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if not path:
        pytest.skip(f"{name} is not installed: `make install` puts it in the venv (requirements-dev.txt)")
    return str(path)


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    out = subprocess.run([tool("kubectl"), "kustomize", str(KUBERNETES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def test_kustomize_renders_every_object(rendered):
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in rendered)
    assert kinds == [
        "ConfigMap/tinyserve-epp", "Deployment/tinyserve", "Deployment/tinyserve-epp", "HTTPRoute/tinyserve",
        "InferencePool/tinyserve", "Role/tinyserve-epp", "RoleBinding/tinyserve-epp", "Service/tinyserve",
        "Service/tinyserve-epp", "ServiceAccount/tinyserve-epp",
    ]  # fmt: skip
    assert all(d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tinyserve" for d in rendered)


def test_built_in_objects_pass_the_kubernetes_schemas_strictly(rendered):
    built_in = [d for d in rendered if d["kind"] not in GATEWAY_KINDS]
    assert len(built_in) == 8
    for doc in built_in:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    typo = json.loads(json.dumps(next(d for d in built_in if d["kind"] == "Deployment")))
    typo["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):  # strict: an unknown field fails
        kubernetes_validate.validate(typo, K8S_VERSION, strict=True)


def test_kubectl_dry_run_accepts_every_object_when_a_cluster_answers(rendered, tmp_path):
    kubectl = tool("kubectl")
    if subprocess.run([kubectl, "version", "--request-timeout=3s"], capture_output=True, timeout=30).returncode != 0:
        pytest.skip("no Kubernetes API server: kubectl's client-side dry run needs one for discovery, even with --validate=false")
    path = tmp_path / "all.yaml"
    path.write_text(yaml.safe_dump_all(rendered))
    out = subprocess.run([kubectl, "apply", "--dry-run=client", "-f", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


# The fields the v1 APIs define for what we use (inference.networking.k8s.io/v1 InferencePool,
# gateway.networking.k8s.io/v1 HTTPRoute), closed to anything else.
PORT = {
    "type": "object",
    "required": ["number"],
    "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
    "additionalProperties": False,
}
INFERENCE_POOL = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "additionalProperties": False,
                    "properties": {"matchLabels": {"type": "object", "minProperties": 1, "additionalProperties": {"type": "string"}}},
                },
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": PORT},
                "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                "endpointPickerRef": {
                    "type": "object",
                    "required": ["name", "port"],
                    "additionalProperties": False,
                    "properties": {
                        "group": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string", "minLength": 1},
                        "port": PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}
REF = {
    "type": "object",
    "required": ["name"],
    "properties": {"group": {"type": "string"}, "kind": {"type": "string"}, "name": {"type": "string"}},
}
HTTP_ROUTE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
        "kind": {"const": "HTTPRoute"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "parentRefs": {"type": "array", "minItems": 1, "items": REF},
                "hostnames": {"type": "array"},
                "rules": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "matches": {"type": "array"},
                            "backendRefs": {"type": "array", "minItems": 1, "items": REF},
                            "timeouts": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {"request": {"type": "string"}, "backendRequest": {"type": "string"}},
                            },
                            "filters": {"type": "array"},
                        },
                    },
                },
            },
        },
    },
}


def test_gateway_objects_have_the_fields_their_apis_define(rendered):
    by_kind = {d["kind"]: d for d in rendered}
    jsonschema.validate(by_kind["InferencePool"], INFERENCE_POOL)
    jsonschema.validate(by_kind["HTTPRoute"], HTTP_ROUTE)
    pool, route = by_kind["InferencePool"], by_kind["HTTPRoute"]
    model = next(d for d in rendered if d["kind"] == "Deployment" and d["metadata"]["name"] == "tinyserve")
    picker = next(d for d in rendered if d["kind"] == "Service" and d["metadata"]["name"] == "tinyserve-epp")
    pod = model["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pool["spec"]["targetPorts"][0]["number"] == pod["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert (pool["spec"]["endpointPickerRef"]["name"], pool["spec"]["endpointPickerRef"]["port"]["number"]) == (
        picker["metadata"]["name"],
        picker["spec"]["ports"][0]["port"],
    )
    assert route["spec"]["rules"][0]["backendRefs"][0] == {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": "tinyserve",
    }
    gateway = yaml.safe_load((KUBERNETES / "gateway.yaml").read_text())
    assert gateway["metadata"]["name"] == route["spec"]["parentRefs"][0]["name"]
    assert gateway["kind"] == "Gateway" and gateway["spec"]["listeners"]


def test_the_model_pods_drain_before_they_are_killed(rendered):
    pod = next(d for d in rendered if d["kind"] == "Deployment" and d["metadata"]["name"] == "tinyserve")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    pre_stop = int(pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + int(env["LLM_DRAIN_SECONDS"]) + 5
    assert env["LLM_METRICS_COMPAT"] == "vllm"  # the endpoint picker reads vLLM's names
    running = {"SLOTS": env["LLM_SLOTS"], "QUEUE_LIMIT": env["LLM_QUEUE_LIMIT"], "MAX_BATCH": env.get("LLM_MAX_BATCH")}
    assert int(env["THREADS"]) >= threads_needed(running)  # every running or queued stream holds a thread
    probes = pod["containers"][0]
    assert {probes[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {"/health"}


# --- the image and the proxy -------------------------------------------------------------------------


def test_hadolint_accepts_the_dockerfile():
    out = subprocess.run([tool("hadolint"), str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_nginx_accepts_the_proxy_config(tmp_path):
    nginx = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
    if not nginx:
        pytest.skip("Debian's nginx is not installed (make test-deploy installs it)")
    (tmp_path / "tinyserve-replicas.conf").write_text("server 127.0.0.1:1 max_fails=0;\nserver 127.0.0.1:2 max_fails=0;\n")
    conf = (ROOT / "deploy" / "nginx" / "tinyserve.conf").read_text().replace("/var/log/nginx/", f"{tmp_path}/")
    (tmp_path / "tinyserve.conf").write_text(conf)
    (tmp_path / "nginx.conf").write_text(
        f"pid {tmp_path}/nginx.pid; error_log {tmp_path}/error.log;\nevents {{}}\nhttp {{ include tinyserve.conf; }}\n"
    )
    out = subprocess.run(
        [nginx, "-t", "-q", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
