"""A deployment on Ray: a head started on 127.0.0.1, `tandem serve --ray` placing a prefill and a decode
worker as actors; greedy outputs equal the offline engine's (as a local deployment's do), and a worker
actor whose process is killed is declared dead, placed again by Ray and serves again."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_utils import TINY, metric, prompts, run_all, settled
from parallel_streams import one_stream_at_a_time
from server_utils import running_server

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray", reason="the ray extra is not installed (scripts/setup.sh installs it)")
DISAGG = ("--prefill-workers", "1", "--decode-workers", "1", "--path-policy", "disaggregated")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 (a generator fixture)
    exe = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    assert exe, "the ray command is missing"
    port = free_port()
    temp = tmp_path_factory.mktemp("ray")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    with one_stream_at_a_time("ray"):  # `ray stop` below stops every Ray cluster of this user
        subprocess.run([exe, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
                        "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"],
                       check=True, capture_output=True, env=env, timeout=180)
        try:
            yield f"127.0.0.1:{port}"
        finally:
            subprocess.run([exe, "stop", "--force"], capture_output=True, env=env, timeout=120)


def worker_pids(log_lines: list[str]) -> dict[str, int]:
    """worker id -> pid, from the router's "placed as a Ray actor" lines."""
    out = {}
    for line in log_lines:
        if "placed as a Ray actor, pid" in line:
            worker_id = line.split("worker ", 1)[1].split(" ", 1)[0]
            out[worker_id] = int(line.rsplit("pid ", 1)[1].split()[0])
    return out


def test_ray_deployment_serves_the_local_outputs_and_survives_a_killed_worker(ray_head: str, passages: list[str],
                                                                              make_llm) -> None:  # noqa: ANN001
    from tandem import SamplingParams

    texts = prompts(passages)
    # Greedy float32 outputs are the same on any deployment (tests/test_disaggregation.py): the offline
    # engine's, on the tiny random model (what is tested is where the workers run, not the model).
    outs = make_llm(model=TINY[0], dtype="float32").generate(texts, SamplingParams(temperature=0.0, max_tokens=24))
    expected = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
    # Ray's own sockets use the node's address; the router and the KV receivers stay on loopback.
    with running_server(*TINY, *DISAGG, "--ray", ray_head, "--router-bind", "tcp://127.0.0.1:0") as s:
        assert run_all(s, texts) == expected
        assert settled(lambda: metric(s, "kv_transfers", outcome="ok"), lambda n: n >= len(texts)) >= len(texts)
        # The router's log names each actor's pid: kill the decode worker's process outright.
        lines: list[str] = []
        deadline = time.monotonic() + 10
        os.set_blocking(s.proc.stdout.fileno(), False)
        while time.monotonic() < deadline and "decode-0" not in worker_pids(lines):
            chunk = s.proc.stdout.read()
            lines += (chunk or "").splitlines()
            time.sleep(0.1)
        pid = worker_pids(lines)["decode-0"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while metric(s, "router_worker_restarts") < 1 or metric(s, "worker_up", worker="decode-0") < 1:
            assert time.monotonic() < deadline, "the killed worker did not come back"
            time.sleep(0.5)
        assert metric(s, "router_worker_deaths") >= 1
        assert run_all(s, texts) == expected


def test_the_ray_launcher_sees_room_on_the_cluster(ray_head: str) -> None:
    """What lets the planner add a worker: free CPUs on the cluster, and none once they are placed."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from tandem.disagg.fleet.ray_launcher import connect, ray_launcher

    try:
        assert connect(ray_head) == ray.nodes()[0]["NodeManagerAddress"]  # the address the cluster knows
        launcher = ray_launcher(1, 1, 0, 1, [], {}, b"secret", "WARNING")
        assert set(launcher.specs) == {"prefill-0", "decode-0"} and launcher.new_slot() == [0]
        deadline = time.monotonic() + 30
        while not launcher.can_grow():  # the previous test's actors are being released
            assert time.monotonic() < deadline
            time.sleep(0.5)
        group = placement_group([{"CPU": 2}])
        ray.get(group.ready(), timeout=60)
        assert not launcher.can_grow()
        remove_placement_group(group)
    finally:
        ray.shutdown()
