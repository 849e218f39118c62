"""``splitserve bench --ray-address ADDR --clients N``: one run's load sent by N client actors on a Ray
cluster, merged into one result with a single client's keys (docs/benchmarks.md#load-clients-on-ray).

One process streams a few tens of thousands of tokens a second at most, so a load test of a cluster
needs clients on several nodes. The driver (the ``splitserve bench`` process):

1. builds the requests and their due times once, as a single client does, and deals them round-robin:
   client k sends requests k, k + N, k + 2N, ... at their due times, each with the seed it has in a
   single run (``seed + index``). N = 1 and N = 3 on the same seed send the same requests at the same
   times; together the shares are the whole arrival process (Poisson with burstiness 1);
2. starts N ``LoadClient`` actors, spread over the nodes (``scheduling_strategy="SPREAD"``), each
   reserving ``client_cpus`` CPUs (more than 0: Ray spreads only actors that ask for a resource), and
   warns when they share fewer nodes than could hold them;
3. measures each client's clock against its own, NTP-style: the shortest of ``CLOCK_SAMPLES`` round
   trips of ``time.time()`` gives the offset within half that round trip;
4. hands every client its share, then one common start a moment ahead (``START_LEAD_S``), converted into
   that client's clock with its offset: every record a client takes (due, sent, TTFT, ITLs, E2EL,
   relative to that start, in its own ``perf_counter``) is then on the driver's time line;
5. polls the clients for the records they have finished (``POLL_S``) until every client returned or the
   run's deadline passed, and measures the offsets again (their drift over the run);
6. merges the records back into request order and summarizes them as one run does: percentiles over the
   merged raw records, never averages of the clients' percentiles.

A client that dies (its node lost, ``ray.kill``) or misses the deadline is reported in
``ray_clients.clients_lost`` with the requests it had, those it finished (kept: their records arrived
before it died) and those it did not, which count as failed with the code ``CLIENT_LOST``.
Every wait has a deadline; the actors are killed when the run ends, whatever happened.
"""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from splitserve.bench.config import BenchConfig
from splitserve.bench.metrics import RequestRecord
from splitserve.bench.progress import Progress
from splitserve.bench.request import BenchRequest
from splitserve.bench.runner import check_openai_model, new_records, result_of, run_requests
from splitserve.common.validate import check_range

START_LEAD_S = 1.0  # from handing out the start to the start itself
PLACE_TIMEOUT_S = 60.0  # for every client to be placed and answer
CALL_TIMEOUT_S = 30.0  # any other call on a client (a clock reading, its share, a poll)
SLACK_S = 30.0  # added to the run's own bound (last due time + request deadlines)
POLL_S = 0.5
CLOCK_SAMPLES = 8
CLOCK_WARN_S = 0.005  # uncertainty (half the best round trip) above which the summary warns
LOST = "CLIENT_LOST"


@dataclass(frozen=True)
class RayLoad:
    """Where and how many load clients run."""

    address: str  # a Ray cluster's address (host:port), as ``ray.init(address=...)`` takes it
    clients: int = 1
    # Ray CPUs each client reserves: more than 0, as Ray places an actor that asks for nothing where it likes,
    # SPREAD or not (measured: 3 such clients on 3 nodes landed on 1 node in some runs).
    client_cpus: float = 1.0
    run_timeout_s: float | None = None  # the whole run's deadline; None: from the load (``run_deadline_s``)

    def __post_init__(self) -> None:
        if not self.address:
            raise ValueError("--ray-address: needed for --clients")
        check_range(self, "clients", min=1, label="--clients")
        check_range(self, "client_cpus", above=0, label="--client-cpus")
        check_range(self, "run_timeout_s", above=0, label="--run-timeout")


def deal(num: int, clients: int) -> list[list[int]]:
    """Request indices per client, round-robin: client k gets k, k + clients, k + 2 * clients, ..."""
    return [list(range(k, num, clients)) for k in range(clients)]


def share_concurrency(max_concurrency: int | None, clients: int) -> list[int | None]:
    """``--max-concurrency`` split over the clients (the first ones get one more), summing to it."""
    if max_concurrency is None:
        return [None] * clients
    if max_concurrency < clients:
        raise ValueError(f"--max-concurrency: {max_concurrency} cannot be shared by {clients} --clients")
    return [max_concurrency // clients + (k < max_concurrency % clients) for k in range(clients)]


def run_deadline_s(offsets_s: Sequence[float], shares: Sequence[Sequence[int]], config: BenchConfig) -> float:
    """From the start: the last due time plus, per client, a request deadline for each wave of its
    concurrency (one wave without ``--max-concurrency``), plus ``SLACK_S``."""
    waves = 1
    for share, limit in zip(shares, share_concurrency(config.max_concurrency, len(shares))):
        if limit:
            waves = max(waves, math.ceil(len(share) / limit))
    return max(offsets_s, default=0.0) + waves * config.request_timeout_s + SLACK_S


def estimate_offset(
    remote_clock: Callable[[], float], samples: int = CLOCK_SAMPLES, local_clock: Callable[[], float] = time.time
) -> tuple[float, float]:
    """(offset, round trip) in seconds: the remote clock minus the local one, read NTP-style: the remote
    reading is taken as the midpoint of the round trip, and of ``samples`` trips the shortest is kept, so
    the offset is off by half that round trip at most."""
    best: tuple[float, float] | None = None
    for _ in range(samples):
        t0 = local_clock()
        remote = remote_clock()
        t1 = local_clock()
        if best is None or t1 - t0 < best[1]:
            best = (remote - (t0 + t1) / 2, t1 - t0)
    assert best is not None
    return best


class LoadClient:
    """One load client: a Ray actor (threaded, so that ``finished`` answers while ``run`` sends)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.records: list[RequestRecord] = []
        self.reported: set[int] = set()
        self.lock = threading.Lock()

    def describe(self) -> dict:
        import ray

        from splitserve.engine.hardware import cpu_summary, describe_machine

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "cpu": cpu_summary(describe_machine(probe_torch=False)),
        }

    def clock(self) -> float:
        return time.time()

    def prepare(
        self, requests: list[BenchRequest], offsets_s: list[float], seeds: list[int], config: BenchConfig
    ) -> int:
        self.requests, self.offsets_s, self.seeds, self.config = requests, offsets_s, seeds, config
        self.records = new_records(requests, offsets_s)
        return len(requests)

    def run(self, start_at: float) -> tuple[list[RequestRecord], float, float]:
        """Sends the share from ``start_at`` (this clock); returns the records, the duration from the start
        and how late the call came (> 0: the start had passed already)."""
        late = time.time() - start_at
        progress = Progress(len(self.requests), enabled=False)
        kwargs = dict(seeds=self.seeds, start_at=start_at, records=self.records)
        if self.config.backend == "openai":
            from splitserve.bench import openai_backend

            run = openai_backend.run_requests(
                self.requests, self.offsets_s, self.config, self.config.model, progress, **kwargs
            )
        else:
            run = run_requests(self.requests, self.offsets_s, self.config, progress=progress, **kwargs)
        records, duration = asyncio.run(run)
        return records, duration, late

    def finished(self) -> list[tuple[int, RequestRecord]]:
        """The records (by position in the share) that finished since the last call."""
        with self.lock:
            new = [(j, r) for j, r in enumerate(self.records) if r.finished and j not in self.reported]
            self.reported.update(j for j, _ in new)
        return new


_joined = False  # this process connected to a cluster for the bench (``disconnect`` undoes it)


def connect(address: str) -> None:
    """Join the cluster at ``address`` unless this process is connected to a Ray already."""
    global _joined
    import ray

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
        _joined = True


def disconnect() -> None:
    global _joined
    if _joined:
        import ray

        ray.shutdown()
        _joined = False


def benchmark(
    requests: Sequence[BenchRequest],
    offsets_s: Sequence[float],
    config: BenchConfig,
    model_id: str = "",
    dataset: str = "",
    *,
    load: RayLoad,
    on_running: Callable[[list[Any]], None] | None = None,
) -> dict:
    """``runner.benchmark`` with the load sent by ``load.clients`` actors: the same keys, plus ``ray_clients``.
    ``on_running`` is called with the actor handles once they send (tests kill one there)."""
    check_openai_model(config)
    records, duration, clients = run_clients(requests, offsets_s, config, load, on_running)
    result = result_of(records, duration, config, model_id, dataset)
    result["ray_clients"] = clients
    return result


def run_clients(
    requests: Sequence[BenchRequest],
    offsets_s: Sequence[float],
    config: BenchConfig,
    load: RayLoad,
    on_running: Callable[[list[Any]], None] | None = None,
) -> tuple[list[RequestRecord], float, dict]:
    """The merged records (request order), the run's duration and the ``ray_clients`` report."""
    import ray

    connect(load.address)
    shares = deal(len(requests), load.clients)
    limits = share_concurrency(config.max_concurrency, load.clients)
    deadline_s = load.run_timeout_s or run_deadline_s(offsets_s, shares, config)
    actor_class = ray.remote(LoadClient).options(
        num_cpus=load.client_cpus, scheduling_strategy="SPREAD", max_concurrency=4, max_restarts=0
    )
    actors = [actor_class.remote(k) for k in range(load.clients)]
    try:  # a client lost before the start fails the run (RuntimeError); one lost after it is reported
        info = _prepare(actors, load, [([requests[i] for i in share], share) for share in shares], offsets_s, config)
        start = time.time() + START_LEAD_S
        runs = {actor.run.remote(start + i["clock_offset_s"]): k for k, (actor, i) in enumerate(zip(actors, info))}
        if on_running is not None:
            on_running(actors)
        progress = Progress(len(requests), config.progress)
        got, returned, lost = _collect(actors, runs, start, deadline_s, progress)
        for k in returned:  # the drift over the run; the offsets used are those measured before
            try:
                offset, _ = estimate_offset(_clock_of(actors[k]), samples=3)
                info[k]["clock_drift_s"] = offset - info[k]["clock_offset_s"]
            except ray.exceptions.RayError:
                info[k]["clock_drift_s"] = None
    finally:
        for actor in actors:
            try:
                ray.kill(actor)
            except ray.exceptions.RayError:
                pass  # gone already
    return _merge(requests, offsets_s, shares, limits, info, got, returned, lost, time.time() - start, load)


def _prepare(
    actors: list, load: RayLoad, shares: list[tuple[list[BenchRequest], list[int]]], offsets_s, config: BenchConfig
) -> list[dict]:
    """Place the clients, read their clocks, hand out the shares; any failure here fails the run."""
    import ray

    try:
        info = _await_placed(actors, load)
        _check_reachable(config, info)
        for k, actor in enumerate(actors):
            info[k]["clock_offset_s"], info[k]["clock_rtt_s"] = estimate_offset(_clock_of(actor))
        limits = share_concurrency(config.max_concurrency, len(actors))
        ray.get(
            [
                actor.prepare.remote(
                    share_requests,
                    [offsets_s[i] for i in share],
                    [config.seed + i for i in share],
                    replace(config, max_concurrency=limit, progress=False),
                )
                for actor, (share_requests, share), limit in zip(actors, shares, limits)
            ],
            timeout=CALL_TIMEOUT_S,
        )
    except ray.exceptions.RayError as e:
        raise RuntimeError(f"--clients: a load client failed before the start: {type(e).__name__}: {e}") from e
    return info


def _check_reachable(config: BenchConfig, info: list[dict]) -> None:
    """A server on a loopback address cannot be reached from clients on other machines: refused here
    rather than left to fail every request."""
    from urllib.parse import urlsplit

    host = urlsplit(config.base_url).hostname if config.backend == "openai" else config.addr.rsplit(":", 1)[0]
    host = (host or "").strip("[]")
    loopback = host in ("localhost", "::1") or host.startswith("127.")
    remote = sorted({i["node_ip"] for i in info if not i["node_ip"].startswith("127.")})
    if loopback and remote:
        target = "--base-url" if config.backend == "openai" else "--addr"
        raise RuntimeError(
            f"{target}: {host} is this machine's loopback; the load clients on {', '.join(remote)} cannot "
            "reach it: give the server's address on the cluster's network"
        )


def _clock_of(actor) -> Callable[[], float]:
    import ray

    return lambda: ray.get(actor.clock.remote(), timeout=CALL_TIMEOUT_S)


def _await_placed(actors: list, load: RayLoad) -> list[dict]:
    """Each client's node and CPU, once every one answers; a client not placed in time fails the run."""
    import ray

    refs = [a.describe.remote() for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PLACE_TIMEOUT_S)
    if len(ready) < len(refs):
        raise RuntimeError(
            f"--clients: {len(ready)} of {load.clients} load clients started within {PLACE_TIMEOUT_S:.0f}s "
            f"(each reserves --client-cpus {load.client_cpus:g} CPUs on {load.address})"
        )
    info = ray.get(refs, timeout=CALL_TIMEOUT_S)
    fit = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) >= load.client_cpus]
    if len({i["node_id"] for i in info}) < min(len(actors), len(fit)):
        print(
            f"splitserve bench: the {len(actors)} load clients share {len({i['node_id'] for i in info})} "
            f"of the {len(fit)} nodes that could hold them",
            file=sys.stderr,
        )
    return info


def _collect(
    actors: list, runs: dict, start: float, deadline_s: float, progress: Progress
) -> tuple[dict[int, dict[int, RequestRecord]], dict[int, tuple[float, float]], dict[int, str]]:
    """Poll until every run returned or failed, or ``deadline_s`` after ``start`` (the driver's
    ``time.time()``). Returns the records got per client (position in its share -> record), (duration,
    lateness) of the clients that returned, and the reason per lost client."""
    import ray

    deadline = start + deadline_s
    got: dict[int, dict[int, RequestRecord]] = {k: {} for k in range(len(actors))}
    returned: dict[int, tuple[float, float]] = {}
    lost: dict[int, str] = {}

    def take(k: int, items) -> None:
        for j, record in items:
            if j not in got[k]:
                progress.update(record.success)
            got[k][j] = record

    try:
        while runs and (left := deadline - time.time()) > 0:
            ready, _ = ray.wait(list(runs), num_returns=1, timeout=min(POLL_S, left))
            for ref in ready:
                k = runs.pop(ref)
                try:
                    records, duration, late = ray.get(ref, timeout=CALL_TIMEOUT_S)
                except ray.exceptions.RayError as e:
                    lost[k] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    continue
                take(k, enumerate(records))
                returned[k] = (duration, late)
            polls = {actors[k].finished.remote(): k for k in runs.values()}
            if polls:
                done, _ = ray.wait(list(polls), num_returns=len(polls), timeout=min(CALL_TIMEOUT_S, max(left, 0.1)))
                for ref in done:
                    try:
                        take(polls[ref], ray.get(ref, timeout=CALL_TIMEOUT_S))
                    except ray.exceptions.RayError:
                        pass  # the client is gone: its run's result says how
        for k in runs.values():
            lost[k] = f"no result within the run's deadline, {deadline_s:.0f}s after the start"
    finally:
        progress.close()
    return got, returned, lost


def _merge(
    requests: Sequence[BenchRequest],
    offsets_s: Sequence[float],
    shares: list[list[int]],
    limits: list[int | None],
    info: list[dict],
    got: dict[int, dict[int, RequestRecord]],
    returned: dict[int, tuple[float, float]],
    lost: dict[int, str],
    elapsed_s: float,
    load: RayLoad,
) -> tuple[list[RequestRecord], float, dict]:
    records: list[RequestRecord | None] = [None] * len(requests)
    per_client, lost_report = [], []
    for k, share in enumerate(shares):
        for j, record in got[k].items():
            records[share[j]] = record
        finished = sorted(share[j] for j in got[k])
        unfinished = sorted(set(share) - set(finished))
        if k in lost:
            lost_report.append(
                {
                    "client": k,
                    "node_id": info[k]["node_id"],
                    "error": lost[k],
                    "requests": len(share),
                    "finished": finished,
                    "unfinished": unfinished,
                }
            )
            for i in unfinished:
                records[i] = RequestRecord(
                    requests[i].prompt_len,
                    requests[i].output_len,
                    due_s=offsets_s[i],
                    sent_s=offsets_s[i],
                    error_code=LOST,
                    error=f"{LOST}: load client {k} on node {info[k]['node_id']}: {lost[k]}",
                )
        duration, late = returned.get(k, (None, None))
        per_client.append(
            {
                "client": k,
                "node_id": info[k]["node_id"],
                "cpu": info[k]["cpu"],
                "requests": share,
                "max_concurrency": limits[k],
                "clock_offset_ms": info[k]["clock_offset_s"] * 1e3,
                "clock_rtt_ms": info[k]["clock_rtt_s"] * 1e3,
                "clock_drift_ms": None if info[k].get("clock_drift_s") is None else info[k]["clock_drift_s"] * 1e3,
                "duration": duration,
                "start_late_ms": None if late is None else late * 1e3,
                "lost": k in lost,
            }
        )
    merged = [r for r in records if r is not None]
    assert len(merged) == len(requests)
    # The run ends with its last request: a lost client's finished ones count, its lost ones do not.
    ends = [d for d, _ in returned.values()] + [r.sent_s + r.e2el_s for r in merged if r.finished]
    duration = max(ends) if ends else elapsed_s
    offsets = [c["clock_offset_ms"] for c in per_client]
    drifts = [abs(c["clock_drift_ms"]) for c in per_client if c["clock_drift_ms"] is not None]
    rtt = max(c["clock_rtt_ms"] for c in per_client)
    report = {
        "address": load.address,
        "clients": load.clients,
        "nodes": len({c["node_id"] for c in per_client}),
        "client_cpus": load.client_cpus,
        "max_clock_offset_ms": max(abs(o) for o in offsets),
        "clock_spread_ms": max(offsets) - min(offsets),  # between the clients' nodes
        "max_clock_rtt_ms": rtt,
        "clock_uncertainty_ms": rtt / 2,
        "max_clock_drift_ms": max(drifts) if drifts else None,
        "per_client": per_client,
        "clients_lost": lost_report,
        "requests_lost": sum(len(c["unfinished"]) for c in lost_report),
    }
    if rtt / 2e3 > CLOCK_WARN_S:
        print(
            f"splitserve bench: client clocks known within {rtt / 2:.1f} ms only (round trip {rtt:.1f} ms): "
            "latencies are per client and exact, the merged time line is off by up to that",
            file=sys.stderr,
        )
    for c in lost_report:
        print(
            f"splitserve bench: load client {c['client']} lost ({c['error']}): {len(c['finished'])} of its "
            f"{c['requests']} requests finished, {len(c['unfinished'])} counted as {LOST}",
            file=sys.stderr,
        )
    return merged, duration, report
