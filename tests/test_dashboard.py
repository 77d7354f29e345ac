"""The dashboard and its JSON endpoint.

GET /v1/cluster is validated against its published schema on the colocated server and on a live
1P1D deployment; the page is loaded in Debian's headless Chromium, asks for the API key, draws the
deployment's workers, and updates when load arrives (a screenshot lands in test-artifacts/).
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest
from browser import chromium, screenshot, wait_for
from server_utils import Server, running_server, web

from tandem.serve.live_stats import LiveStats
from tandem.slo import Slo

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "tandem/serve/cluster_schema.json").read_text())
GRAFANA = ROOT / "deploy/grafana/tandem-dashboard.json"
KEY = "dashboard-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SMALL = ("--dtype", "float32", "--kv-cache-memory", "0.25", "--max-num-batched-tokens", "64")


def complete(server: Server, prompt: str, max_tokens: int = 8) -> dict:
    r = web.post(f"{server.url}/v1/completions", headers=AUTH, timeout=120,
                 json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def cluster(server: Server) -> dict:
    r = web.get(f"{server.url}/v1/cluster", headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    body = r.json()
    jsonschema.validate(body, SCHEMA)
    return body


# -- the time window --------------------------------------------------------------------------
def test_live_stats_buckets_percentiles_and_goodput() -> None:
    now = [1000.0]
    live = LiveStats(Slo(ttft_s=0.5, tpot_s=0.05), bucket_s=5.0, window_s=20.0, clock=lambda: now[0])
    for i in range(10):  # bucket [1000, 1005): ten requests, TTFT 0.1..1.0 s, TPOT 40 ms
        live.finished(0.1 * (i + 1), 0.04, ok=True, queue_s=0.01 * (i + 1))
        live.tokens(3)
    live.finished(None, None, ok=False)
    now[0] = 1006.0  # the next bucket: one slow-TPOT request and some token gaps
    live.finished(0.2, 0.2, ok=True)
    for gap in (0.01, 0.02, 0.03):
        live.token_gap(gap)
    live.gauges(running=4, waiting=1, kv_usage=0.5)

    first, second = live.series()
    assert (first["t"], second["t"]) == (1000.0, 1005.0)
    assert (first["finished"], first["good"], first["failed"]) == (10, 5, 1)  # TTFT <= 0.5 s: five of ten
    assert first["ttft_ms"]["p50"] == pytest.approx(550.0) and first["queue_ms"]["p50"] == pytest.approx(55.0)
    assert first["output_tok_s"] == pytest.approx(30 / 5.0)
    assert (second["good"], second["running"], second["kv_usage"]) == (0, 4, 0.5)
    assert second["itl_ms"]["p50"] == pytest.approx(20.0)
    window = live.window(60.0)
    assert (window["finished"], window["good"], window["failed"]) == (11, 5, 1)
    assert window["slo_attainment"] == pytest.approx(5 / 11)
    assert window["seconds"] == pytest.approx(6.0)  # only as far back as the oldest bucket
    now[0] = 1031.0  # 20 s of window: both old buckets have rolled out
    assert live.window(60.0)["finished"] == 0
    assert [b["t"] for b in live.series()] == [1030.0]


# -- the colocated server ---------------------------------------------------------------------
def test_cluster_endpoint_on_the_colocated_server() -> None:
    with running_server(*SMALL, "--api-key", KEY, "--slo-ttft-ms", "60000", "--slo-tpot-ms", "10000") as server:
        page = web.get(f"{server.url}/dashboard", timeout=10)
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        for asset in re.findall(r'(?:src|href)="(/dashboard/static/[^"]+)"', page.text):
            assert web.get(f"{server.url}{asset}", timeout=10).status_code == 200, asset
        refused = web.get(f"{server.url}/v1/cluster", timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "AuthenticationError"

        before = cluster(server)
        # A cluster of one: the router in the API process, one colocated worker on every core.
        assert before["mode"] == "colocated" and before["router"]["pid"] == server.proc.pid
        [core] = before["workers"]
        assert (core["role"], core["state"]) == ("colocated", "up") and core["kv_total_blocks"] > 0
        assert core["cores"] == sorted(os.sched_getaffinity(0)), "the lone worker's CPU affinity: every core"
        assert before["slo"] == {"ttft_ms": 60000.0, "tpot_ms": 10000.0}
        # Nothing in flight, and no other worker: a live migration moves nothing.
        moved = web.post(f"{server.url}/v1/cluster/workers/{core['id']}/migrate",
                         headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert moved.status_code == 200 and moved.json()["migrated"] == []

        for i in range(3):
            complete(server, f"Count to {i + 3}:", max_tokens=6)
        after = cluster(server)
        assert after["window"]["finished"] == 3 and after["window"]["good"] == 3
        assert after["window"]["ttft_ms"]["p50"] > 0 and after["window"]["tpot_ms"]["p99"] > 0
        assert 0 <= after["window"]["queue_ms"]["p50"] <= after["window"]["ttft_ms"]["p50"]
        assert after["totals"]["generation_tokens"] - before["totals"]["generation_tokens"] == 18
        assert sum(b["finished"] for b in after["series"]) == 3


# -- a live 1P1D deployment -------------------------------------------------------------------
@pytest.fixture(scope="module")
def deployment():  # noqa: ANN201
    # A small host-memory tier, so that the store's panel and series have something to show.
    with running_server(*SMALL, "--api-key", KEY, "--prefill-workers", "1", "--decode-workers", "1",
                        "--path-policy", "disaggregated",
                        "--kv-offload-memory", "0.05") as server:
        yield server


@pytest.mark.slow
def test_dashboard_renders_the_deployment_and_updates_under_load(deployment: Server) -> None:
    from selenium.webdriver.common.by import By

    with chromium() as driver:
        driver.get(f"{deployment.url}/dashboard?interval=0.5")
        # No key yet: the page asks for one instead of showing anything.
        form = wait_for(lambda: driver.find_element(By.ID, "auth").is_displayed(), 20, "the API-key form")
        assert form and not driver.find_element(By.ID, "main").is_displayed()
        driver.find_element(By.ID, "auth-key").send_keys(KEY)
        driver.find_element(By.CSS_SELECTOR, "#auth button").click()
        wait_for(lambda: int(driver.find_element(By.TAG_NAME, "body").get_attribute("data-polls")) > 0, 20,
                 "the first poll")

        # Read in one script: the map is redrawn on every poll, so elements found earlier go stale.
        roles = sorted(tuple(r) for r in driver.execute_script(
            "return [...document.querySelectorAll('#map g.worker')].map(n => [n.dataset.role, n.dataset.state])"))
        assert roles == [("decode", "up"), ("prefill", "up")]
        assert driver.find_elements(By.CSS_SELECTOR, "#map g.router")
        assert len(driver.find_elements(By.CSS_SELECTOR, "#workers tbody tr")) == 2
        assert len(driver.find_elements(By.CSS_SELECTOR, ".chart canvas")) >= 7  # the uPlot charts drew
        assert not driver.find_elements(By.CSS_SELECTOR, "#map path.transfer")
        tokens_before = int(driver.find_element(By.ID, "stat-generation-tokens").text)

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: complete(deployment, f"Write a line about the number {i}.", 12), range(4)))

        def grew() -> bool:
            text = driver.find_element(By.ID, "stat-generation-tokens").text
            return text.isdigit() and int(text) >= tokens_before + 48
        wait_for(grew, 20, "the generated-token count to take the new load in")
        wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, "#map path.transfer"), 20, "a KV transfer edge")
        assert driver.find_element(By.ID, "stat-ttft").text.endswith("ms")
        assert driver.find_element(By.ID, "stat-ttft").text != "– / – ms"
        path = screenshot(driver, "dashboard-1p1d.png")
        assert path.stat().st_size > 10_000
        # The one 401 before the key was given is expected; nothing else may have failed.
        errors = [e for e in driver.get_log("browser")
                  if e["level"] == "SEVERE" and "status of 401" not in e["message"]]
        assert not errors, errors


@pytest.mark.slow
def test_cluster_endpoint_on_a_1p1d_deployment(deployment: Server) -> None:
    complete(deployment, "One more request for the transfer counters.", 4)
    body = cluster(deployment)
    assert body["mode"] == "disaggregated" and body["router"]["address"].startswith("tcp://127.0.0.1:")
    assert sorted(w["role"] for w in body["workers"]) == ["decode", "prefill"]
    [edge] = body["transfers"]
    assert edge["from"].startswith("prefill") and edge["to"].startswith("decode") and edge["bytes"] > 0
    prefill = next(w for w in body["workers"] if w["role"] == "prefill")
    assert prefill["kv_bytes_sent"] >= edge["bytes"] // 2  # shm writes land without the receiver counting


@pytest.mark.slow
def test_grafana_dashboard_names_only_metrics_the_router_exports(deployment: Server) -> None:
    dashboard = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"]]
    assert len(exprs) >= 12
    named = {m for e in exprs for m in re.findall(r"tandem:[A-Za-z0-9_:]+", e)}
    metrics = web.get(f"{deployment.url}/metrics", headers=AUTH, timeout=10).text
    exported = {line.split("{")[0].split(" ")[0] for line in metrics.splitlines() if line and line[0] != "#"}
    assert named and not named - exported, sorted(named - exported)
