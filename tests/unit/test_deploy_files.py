"""The deployment files, read as text without running any tool: the Dockerfile's install steps
mirror `make install` line for line, `.dockerignore` lets through what the Dockerfile copies,
compose's files and grace period fit, and every metric the Grafana dashboard reads is one /metrics
exports. What kubectl, kubernetes-validate, hadolint and nginx say of them is
tests/e2e/test_deploy_manifests.py."""

import json
import re

import yaml
from prometheus_client.parser import text_string_to_metric_families
from support import ROOT

from webapp import DEFAULTS, create_app


def commands(text: str) -> list[str]:
    """Shell commands of a recipe or of RUN steps: continuation lines joined, split at &&."""
    text = text.replace("\\\n", " ")
    return [" ".join(c.split()) for line in text.splitlines() for c in line.split("&&") if c.strip()]


def test_the_dockerfile_installs_what_make_install_installs():
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^\$\(STAMP\):.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    make_steps = [c for c in commands(recipe) if re.search(r"apt-get install|-m venv|pip install", c)]
    dockerfile = (ROOT / "Dockerfile").read_text()
    runs = "\n".join(m.group(1) for m in re.finditer(r"^RUN ((?:.*\\\n)*.*)$", dockerfile, re.M))
    docker_steps = [c for c in commands(runs) if re.search(r"apt-get install|-m venv|pip install", c)]

    def same(step: str) -> str:  # the image's venv is /opt/venv and it carries no test tools
        step = re.sub(r"^.*?(apt-get install)", r"\1", step)  # drop the Makefile's `if ...; then` guard
        step = step.split(" >/dev/null")[0].replace("$(VENV)", "/opt/venv").replace("$(PYTHON)", "python3")
        step = step.replace("test -x /opt/venv/bin/python || ", "").replace("requirements-dev.txt", "requirements.txt")
        step = step.replace(" --no-install-recommends", "")
        return step

    assert [same(s) for s in make_steps] == [same(s) for s in docker_steps]
    assert len(make_steps) == 4


def test_dockerignore_lets_through_what_the_dockerfile_copies():
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    copied = {src for m in re.finditer(r"^COPY (.+) \S+$", (ROOT / "Dockerfile").read_text(), re.M) for src in m.group(1).split()}
    assert copied == allowed
    assert all((ROOT / name).exists() for name in copied)


def test_compose_runs_replicas_behind_nginx_with_a_drain_long_enough():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    app, proxy = compose["services"]["tinyserve"], compose["services"]["nginx"]
    assert app["deploy"]["replicas"] == "${REPLICAS:-2}" and app["build"] == "."
    assert int(app["stop_grace_period"].rstrip("s")) > app["environment"]["LLM_DRAIN_SECONDS"]
    assert proxy["depends_on"]["tinyserve"]["condition"] == "service_healthy"
    for mount in proxy["volumes"]:
        assert (ROOT / mount.split(":")[0]).is_file(), mount


def test_the_grafana_dashboard_reads_only_metrics_we_export(stats_engine):
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "tinyserve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append(dashboard["templating"]["list"][1]["definition"])
    read = {name for e in exprs for name in re.findall(r"\bllm_\w+", e)}
    text = create_app({"TESTING": True}, engine=stats_engine).test_client().get("/metrics").get_data(as_text=True)
    exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert read and read <= exported, read - exported
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    assert DEFAULTS["METRICS_COMPAT"] is None  # the dashboard needs no aliases
