"""The router dies (its kill point: the ``serve`` process exits at once, as a crash would) while streams
run. Clients get UNAVAILABLE within 5 s, not a hang; Ray ends the dead deployment's workers (their
owner is gone), so nothing is left holding KV memory on the cluster; and ``serve`` started again (as a
supervisor would) on the same cluster and port serves again, exactly (``tests/harness/drill.py``)."""

from __future__ import annotations

import grpc

from tests.harness.drill import ROUTER_KILL_AFTER_TOKENS, reference_outputs, run_router_drill


def test_router_killed_mid_stream_then_restarted(serving_model, tmp_path):
    reference = reference_outputs(serving_model)
    r = run_router_drill(serving_model, tmp_path)
    assert r["listening_before"] and len(r["workers"]) == 2
    assert r["exit_code"] != 0
    # At most the kill point's tokens were relayed in all, then every stream ended UNAVAILABLE, at once.
    assert 40 < sum(len(s["tokens"]) for s in r["streams"]) <= ROUTER_KILL_AFTER_TOKENS
    assert all(s["code"] == grpc.StatusCode.UNAVAILABLE for s in r["streams"]), [s["code"] for s in r["streams"]]
    assert r["streams_ended_within_s"] < 5
    for stream, want in zip(r["streams"], reference):
        assert stream["tokens"] == want[: len(stream["tokens"])]
    # Ray ended the dead driver's workers (their ports closed), counted from the router's last token: under
    # half a second measured; serve again on the same port serves exactly and stops cleanly.
    assert 0 < r["workers_gone_within_s"] < 5, r["workers_gone_within_s"]
    assert r["same_port"] and r["again_exit"] == 0
    assert [s["tokens"] for s in r["after"]] == reference
    assert all(s["code"] == grpc.StatusCode.OK for s in r["after"])
