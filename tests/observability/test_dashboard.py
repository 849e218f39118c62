"""cluster_configs/grafana/splitserve.json: valid JSON that Grafana imports (a datasource input
`DS_PROMETHEUS`), whose every query names metrics that splitserve exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

from splitserve.router.metrics import RouterMetrics
from splitserve.worker_common.metrics import WorkerMetrics
from tests.observability.scrape import exposable_names

DASHBOARD = Path(__file__).resolve().parents[2] / "cluster_configs" / "grafana" / "splitserve.json"


def exposed() -> set[str]:
    router = RouterMetrics()
    router.watch(SimpleNamespace(dispatcher=None, inflight=set(), pool=None))
    worker = WorkerMetrics("w-0", "prefill")
    worker.watch(
        SimpleNamespace(
            status_message=lambda: SimpleNamespace(
                running=0, waiting=0, kv_blocks_total=0, kv_blocks_in_use=0, kv_blocks_cached=0
            ),
            kv_pairs=lambda: 0,
            engine=SimpleNamespace(num_preemptions=0),
        )
    )
    return exposable_names(router.registry, worker.registry)


def test_every_query_names_an_exposed_metric():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    assert len(panels) >= 12 and exprs
    queried = {name for expr in exprs for name in re.findall(r"\bsplitserve_[a-z0-9_]+\b", expr)}
    missing = queried - exposed()
    assert not missing, f"the dashboard queries metrics nobody exposes: {sorted(missing)}"
    wanted = {
        "splitserve_requests_total",
        "splitserve_time_to_first_token_seconds_bucket",
        "splitserve_inter_token_latency_seconds_bucket",
        "splitserve_e2e_request_latency_seconds_bucket",
        "splitserve_requests_waiting",
        "splitserve_worker_requests_running",
        "splitserve_worker_kv_blocks_in_use",
        "splitserve_prefix_cache_hit_tokens_total",
        "splitserve_engine_kv_transfer_bytes_total",
        "splitserve_kv_transfer_seconds_bucket",
    }
    assert wanted <= queried, f"panels missing for {sorted(wanted - queried)}"
    for expr in exprs:  # a histogram's buckets are only ever read through a rate and by le
        if "_bucket" in expr:
            assert "histogram_quantile(" in expr and "rate(" in expr and "le" in expr, expr


def test_panels_use_the_datasource_input_and_do_not_overlap():
    dashboard = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert [v["name"] for v in dashboard["templating"]["list"] if v["type"] == "datasource"] == ["DS_PROMETHEUS"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        area = {(g["x"] + dx, g["y"] + dy) for dx in range(g["w"]) for dy in range(g["h"])}
        assert not area & cells, f"panel {p['title']!r} overlaps another"
        cells |= area
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${DS_PROMETHEUS}"
            assert all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in p["targets"])
