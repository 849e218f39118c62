"""Read a /metrics endpoint (or a registry) into something tests can query."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families


class Scrape:
    def __init__(self, text: str) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = [s for f in self.families.values() for s in f.samples]

    @classmethod
    def http(cls, address: str) -> Scrape:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain")
            return cls(response.read().decode())

    @classmethod
    def registry(cls, registry: CollectorRegistry) -> Scrape:
        return cls(generate_latest(registry).decode())

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples named ``name`` whose labels include ``labels`` (0 if none)."""
        return sum(s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items())

    def label_sets(self, name: str) -> list[dict[str, str]]:
        return [s.labels for s in self.samples if s.name == name]

    @property
    def sample_names(self) -> set[str]:
        return {s.name for s in self.samples}


def exposable_names(*registries: CollectorRegistry) -> set[str]:
    """Every sample name these registries can expose, labelled series not yet observed included."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {f.name + suffix for r in registries for f in r.collect() for suffix in suffixes[f.type]}


def timed_worker_scrapes(address: str) -> dict[str, tuple[float, Scrape]]:
    """Every worker's /metrics (the router at ``address`` lists them), each with the moment it was read: the
    middle of its HTTP call, on ``time.perf_counter``."""
    from splitserve.client.grpc_client import Client

    with Client(address) as client:
        endpoints = {w.worker_id: w.metrics_address for w in client.status().workers}
    scrapes = {}
    for worker_id, endpoint in endpoints.items():
        before = time.perf_counter()
        scrape = Scrape.http(endpoint)
        scrapes[worker_id] = ((before + time.perf_counter()) / 2, scrape)
    return scrapes


def loop_phases(first: tuple[float, Scrape], last: tuple[float, Scrape]) -> tuple[float, dict[str, float]]:
    """A worker's wall clock between two ``timed_worker_scrapes`` and its loop's seconds by phase in it."""
    (t0, before), (t1, after) = first, last
    name = "splitserve_worker_loop_seconds_total"
    phases = {labels["phase"] for labels in after.label_sets(name)}
    return t1 - t0, {p: after.value(name, phase=p) - before.value(name, phase=p) for p in phases}
