"""``splitserve bench --ray-address --clients N``: the load dealt to client actors and merged back.

Without Ray: the deal, the concurrency split, the run's deadline, the clock-offset estimate on fake
clocks, and the options refused by name. With the session's Ray and a served tiny model: N = 1 and
N = 3 on the same seed send the same requests and give one process's keys; a client killed mid-run is
reported with the requests it had, and the run still ends. Through the command line against a
simulated 3-node cluster: the clients land on 3 nodes (SPREAD) and the summary says so."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from splitserve.bench import ray_clients
from splitserve.bench.config import BenchConfig
from splitserve.bench.ray_clients import (
    LOST,
    START_LEAD_S,
    RayLoad,
    deal,
    estimate_offset,
    run_deadline_s,
    share_concurrency,
)
from splitserve.bench.request import BenchRequest
from splitserve.cli import main
from tests.serving.conftest import start_deployment


def test_deal_is_round_robin_and_covers_every_request_once():
    assert deal(7, 3) == [[0, 3, 6], [1, 4], [2, 5]]
    assert deal(2, 3) == [[0], [1], []]
    assert deal(5, 1) == [[0, 1, 2, 3, 4]]
    shares = deal(1000, 7)
    assert sorted(i for s in shares for i in s) == list(range(1000))


def test_the_concurrency_is_shared_and_sums_to_the_limit():
    assert share_concurrency(None, 3) == [None, None, None]
    assert share_concurrency(8, 3) == [3, 3, 2] and sum(share_concurrency(101, 7)) == 101
    with pytest.raises(ValueError, match="--max-concurrency: 2 cannot be shared by 3 --clients"):
        share_concurrency(2, 3)


def test_the_run_deadline_covers_the_last_arrival_and_each_wave():
    config = BenchConfig(request_timeout_s=10.0)
    assert run_deadline_s([0.0, 1.0, 4.0], deal(3, 2), config) == pytest.approx(4.0 + 10.0 + ray_clients.SLACK_S)
    closed = BenchConfig(request_timeout_s=10.0, max_concurrency=2)
    # 9 requests over 2 clients with 1 slot each: 5 waves for the first client.
    assert run_deadline_s([0.0] * 9, deal(9, 2), closed) == pytest.approx(50.0 + ray_clients.SLACK_S)


def test_the_clock_offset_comes_from_the_shortest_round_trip():
    now = [100.0]
    trips = iter([0.010, 0.002, 0.030, 0.004])  # the remote clock is read halfway through each trip

    def local():
        return now[0]

    def remote():
        trip = next(trips)
        now[0] += trip / 2
        reading = now[0] + 5.0 + (0.003 if trip != 0.002 else 0.0)  # asymmetric delays off the best trip
        now[0] += trip / 2
        return reading

    offset, rtt = estimate_offset(remote, samples=4, local_clock=local)
    assert rtt == pytest.approx(0.002) and offset == pytest.approx(5.0)


def test_a_loopback_server_is_refused_for_clients_on_other_machines():
    from splitserve.bench.ray_clients import _check_reachable

    here, there = [{"node_ip": "127.0.0.1"}], [{"node_ip": "127.0.0.1"}, {"node_ip": "10.0.0.7"}]
    _check_reachable(BenchConfig(addr="127.0.0.1:50051"), here)
    _check_reachable(BenchConfig(addr="10.0.0.2:50051"), there)
    with pytest.raises(RuntimeError, match="--addr: 127.0.0.1 is this machine's loopback; .* on 10.0.0.7 cannot"):
        _check_reachable(BenchConfig(addr="127.0.0.1:50051"), there)
    with pytest.raises(RuntimeError, match="--base-url: localhost"):
        _check_reachable(BenchConfig(backend="openai", base_url="http://localhost:8000"), there)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--clients", "3"], "--clients: only with --ray-address"),
        (["--client-cpus", "1", "--run-timeout", "5"], "--client-cpus, --run-timeout: only with --ray-address"),
        (["--ray-address", "127.0.0.1:1", "--clients", "0"], "--clients"),
        (["--ray-address", "127.0.0.1:1", "--client-cpus", "0"], "--client-cpus"),
        (["--ray-address", "127.0.0.1:1", "--run-timeout", "0"], "--run-timeout"),
    ],
)
def test_bad_client_options_are_refused_by_name(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def deployment(ray_session, serving_model):
    deployment = start_deployment(serving_model, openai_port=0)  # openai_port: the --backend openai test
    yield deployment
    deployment.stop()


@pytest.fixture(scope="module")
def gcs_address(ray_session):
    import ray

    return ray.get_runtime_context().gcs_address


def requests_of(num: int, seed: int = 0) -> list[BenchRequest]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [BenchRequest(rng.integers(300, 1800, size=int(rng.integers(8, 24))).tolist(), 6) for _ in range(num)]


def test_one_and_three_clients_send_the_same_requests_with_one_process_keys(deployment, gcs_address):
    from splitserve.bench.arrivals import arrival_offsets
    from splitserve.bench.runner import benchmark

    requests = requests_of(12)
    offsets = arrival_offsets(12, 20.0, 1.0, seed=4)
    config = BenchConfig(addr=deployment.address, request_rate=20.0, seed=4, progress=False, request_timeout_s=60)
    single = benchmark(requests, offsets, config, "tiny", "random")
    results = {
        n: ray_clients.benchmark(
            requests, offsets, config, "tiny", "random", load=RayLoad(gcs_address, clients=n, client_cpus=0.1)
        )
        for n in (1, 3)
    }
    for n, result in results.items():
        assert set(result) - set(single) == {"ray_clients"} and set(single) <= set(result)
        assert result["completed"] == 12 and result["failed"] == 0, result["errors"]
        for key in ("num_prompts", "input_lens", "expected_output_lens", "output_lens", "total_input_tokens"):
            assert result[key] == single[key], key
        assert all(t > 0 for t in result["ttfts"]) and all(e >= t for e, t in zip(result["e2els"], result["ttfts"]))
        clients = result["ray_clients"]
        assert clients["clients"] == n and clients["nodes"] == 1 and clients["clients_lost"] == []
        assert [c["requests"] for c in clients["per_client"]] == deal(12, n)
        # One machine: the clocks agree to well within a round trip's worth of error.
        for c in clients["per_client"]:
            assert c["clock_rtt_ms"] > 0 and abs(c["clock_offset_ms"]) < max(5.0, c["clock_rtt_ms"])
            assert c["duration"] > 0 and c["start_late_ms"] < 0  # each client had its share before the start
        assert clients["max_clock_offset_ms"] == max(abs(c["clock_offset_ms"]) for c in clients["per_client"])
        # The merged run's percentiles are those of the merged raw records.
        import numpy as np

        assert result["p90_ttft_ms"] == pytest.approx(np.percentile(np.array(result["ttfts"]) * 1e3, 90))
        assert result["duration"] >= max(offsets)
    assert set(results[1]) == set(results[3])


def test_a_client_killed_mid_run_is_reported_and_the_run_ends(deployment, gcs_address):
    import ray

    requests = requests_of(12, seed=1)
    offsets = [0.25 * i for i in range(12)]  # client 1 of 3: requests 1, 4, 7, 10 due at 0.25, 1, 1.75, 2.5 s
    config = BenchConfig(addr=deployment.address, request_rate=4.0, progress=False, request_timeout_s=60)
    killed = []

    def kill_client_1(actors):
        timer = threading.Timer(START_LEAD_S + 1.5, lambda: killed.append(ray.kill(actors[1])))
        timer.daemon = True
        timer.start()

    started = time.monotonic()
    result = ray_clients.benchmark(
        requests, offsets, config, load=RayLoad(gcs_address, clients=3, client_cpus=0.1), on_running=kill_client_1
    )
    assert killed and time.monotonic() - started < 30
    clients = result["ray_clients"]
    [lost] = clients["clients_lost"]
    assert lost["client"] == 1 and lost["requests"] == 4 and "ActorDied" in lost["error"], lost
    assert sorted(lost["finished"] + lost["unfinished"]) == [1, 4, 7, 10]
    assert 1 in lost["finished"] and {7, 10} <= set(lost["unfinished"])  # reported before the kill, due after it
    assert clients["requests_lost"] == len(lost["unfinished"])
    assert [c["lost"] for c in clients["per_client"]] == [False, True, False]
    assert result["failures"] == {LOST: len(lost["unfinished"])}
    assert result["completed"] == 12 - len(lost["unfinished"]) and result["failed"] == len(lost["unfinished"])
    for i in range(12):
        assert (result["errors"][i].startswith(f"{LOST}: load client 1")) == (i in lost["unfinished"])
    assert all(result["output_lens"][i] == 6 for i in lost["finished"])  # what it finished counts


def test_the_openai_backend_is_dealt_and_merged_too(deployment, gcs_address):
    import asyncio

    from splitserve.bench.openai_backend import list_models

    base_url = f"http://{deployment.openai_address}"
    [model] = [m["id"] for m in asyncio.run(list_models(base_url))]
    config = BenchConfig(
        backend="openai", base_url=base_url, model=model, max_concurrency=4, progress=False, request_timeout_s=60
    )
    requests = requests_of(8, seed=2)
    result = ray_clients.benchmark(requests, [0.0] * 8, config, load=RayLoad(gcs_address, clients=2, client_cpus=0.1))
    assert result["backend"] == "openai" and result["completed"] == 8 and result["failed"] == 0, result["errors"]
    assert result["output_lens"] == [6] * 8 and result["input_lens"] == [r.prompt_len for r in requests]
    assert [c["max_concurrency"] for c in result["ray_clients"]["per_client"]] == [2, 2]  # 4 shared by 2 clients
    with pytest.raises(ValueError, match="--model"):
        ray_clients.benchmark(requests, [0.0] * 8, BenchConfig(backend="openai", base_url=base_url), load=RayLoad("x"))


def test_the_command_line_spreads_clients_over_the_nodes_of_a_cluster(deployment, tmp_path):
    from splitserve.deploy.sim_cluster import SimCluster

    path = tmp_path / "result.json"
    with SimCluster([("decode", 1), ("decode", 1)]) as sim:  # a head and two nodes
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "splitserve.cli",
                "bench",
                "--addr",
                deployment.address,
                "--ray-address",
                sim.address,
                "--clients",
                "3",
                "--client-cpus",
                "0.1",  # 3 nodes of 1 CPU each: nothing but SPREAD keeps them apart
                "--num-prompts",
                "9",
                "--input-len",
                "16",
                "--output-len",
                "4",
                "--request-rate",
                "20",
                "--no-progress",
                "--request-timeout",
                "60",
                "--save-result",
                str(path),
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
        nodes = set(sim.nodes.values())
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Load clients (Ray):                      3 on 3 node(s)" in out.stdout, out.stdout
    result = json.loads(path.read_text())
    assert result["completed"] == 9 and result["failed"] == 0
    clients = result["ray_clients"]
    assert {c["node_id"] for c in clients["per_client"]} == nodes and clients["nodes"] == 3
    assert clients["max_clock_drift_ms"] is not None and clients["clients_lost"] == []
