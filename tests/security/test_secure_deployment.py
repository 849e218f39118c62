"""One served deployment with every security setting on: TLS and API keys on the public port, mTLS
and a cluster token on every internal link (worker registration, the router's calls to workers, the
KV-transfer control stream). Real Ray actors, real certificates."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.client.grpc_client import Client
from splitserve.rpc import kv_transfer_pb2 as kpb
from splitserve.rpc import kv_transfer_pb2_grpc as kpb_grpc
from splitserve.rpc import workers_pb2 as wpb
from splitserve.rpc import workers_pb2_grpc as wpb_grpc
from splitserve.rpc.auth import open_channel
from splitserve.rpc.security import ClientSecurity, InternalSecurity
from splitserve.v1 import splitserve_pb2 as pb
from splitserve.v1 import splitserve_pb2_grpc as pb_grpc
from tests.serving.conftest import start_deployment, wait_for
from tests.serving.netstat import assert_listens_on_loopback_only

CLUSTER_TOKEN = "cluster-secret-5f2a"
API_KEYS = ("key-alpha", "key-beta")


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("secrets")
    (folder / "api-keys").write_text("# public API keys\n" + "\n".join(API_KEYS) + "\n")
    (folder / "cluster-token").write_text(CLUSTER_TOKEN + "\n")
    return folder


@pytest.fixture(scope="module")
def secure(ray_session, serving_model, certs, secrets_dir):
    pem = lambda name: str(certs / name)  # noqa: E731
    deployment = start_deployment(
        serving_model,
        security={
            "tls_cert": pem("server.pem"),
            "tls_key": pem("server.key"),
            "api_key_file": str(secrets_dir / "api-keys"),
            "internal_tls_cert": pem("server.pem"),
            "internal_tls_key": pem("server.key"),
            "internal_tls_ca": pem("ca.pem"),
            "cluster_token_file": str(secrets_dir / "cluster-token"),
        },
    )
    yield deployment
    deployment.stop()


@pytest.fixture(scope="module")
def reference(serving_model):
    from splitserve.engine import LLM

    return LLM(serving_model, dtype="float32", num_blocks=64)


def client(deployment, certs, api_key: str | None = API_KEYS[1]) -> Client:
    return Client(deployment.address, timeout_s=60, api_key=api_key, tls_ca=str(certs / "ca.pem"))


def cluster_member(certs, token: str | None = CLUSTER_TOKEN) -> InternalSecurity:
    return InternalSecurity(str(certs / "server.pem"), str(certs / "server.key"), str(certs / "ca.pem"), token=token)


def test_greedy_generation_end_to_end(secure, certs, reference):
    """Workers registered over mTLS, the router reached them, and the KV moved (its pair formed)."""
    from splitserve.engine import SamplingParams

    prompts = [[5, 9, 14, 2, 7] * 7, [100, 200, 300]]
    with client(secure, certs) as c:
        results = [c.generate(token_ids=p, max_tokens=12, temperature=0.0, ignore_eos=True) for p in prompts]
        expected = reference.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        assert [r.token_ids for r in results] == [e.token_ids for e in expected]
        assert all(r.timing["decode_worker"] == "decode-0" and r.timing["transfer_ms"] > 0 for r in results)
        wait_for(lambda: all(w.kv_blocks_in_use == 0 for w in c.status().workers), timeout_s=10)


@pytest.mark.parametrize("call", ["Generate", "GetStatus"])
def test_the_public_api_needs_an_api_key(secure, certs, call):
    request = pb.GenerateRequest(token_ids=[1, 2, 3]) if call == "Generate" else pb.GetStatusRequest()
    for key, message in [(None, "needs an API key"), ("key-gamma", "not valid")]:
        with ClientSecurity(api_key=key, tls_ca=str(certs / "ca.pem")).channel(secure.address) as channel:
            method = getattr(pb_grpc.SplitServeStub(channel), call)
            with pytest.raises(grpc.RpcError) as e:
                reply = method(request, timeout=10)
                list(reply) if call == "Generate" else reply
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and message in e.value.details()
    with client(secure, certs, api_key=API_KEYS[0]) as c:
        assert len(c.status().workers) == 2


def test_health_is_open_and_plaintext_is_refused(secure, certs):
    with ClientSecurity(tls_ca=str(certs / "ca.pem")).channel(secure.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(secure.address) as channel, pytest.raises(grpc.RpcError) as e:
        pb_grpc.SplitServeStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SPLITSERVE_")} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "splitserve.cli", *args], capture_output=True, text=True, timeout=120, env=environment
    )


def test_cli_over_tls_with_keys_and_the_cluster_token(secure, certs, secrets_dir):
    tls = ("--addr", secure.address, "--tls-ca", str(certs / "ca.pem"))
    out = run_cli(
        "generate", *tls, "--token-ids", "4,5,6", "--max-tokens", "3", "--json", env={"SPLITSERVE_API_KEY": API_KEYS[0]}
    )
    assert out.returncode == 0, out.stderr
    assert '"finish_reason": "length"' in out.stdout.splitlines()[-1]
    assert run_cli("status", *tls, "--api-key", API_KEYS[1], "--json").returncode == 0
    refused = run_cli("status", *tls)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    # Scaling is an operator's call: an API key is not enough once there is a cluster token.
    scale = ("scale", *tls, "--prefill", "1", "--decode", "1", "--timeout", "60")
    refused = run_cli(*scale, "--api-key", API_KEYS[0])
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr and "cluster token" in refused.stderr
    done = run_cli(*scale, "--cluster-token-file", str(secrets_dir / "cluster-token"))
    assert done.returncode == 0 and "1 prefill and 1 decode workers" in done.stdout, done.stderr


def internal_calls(deployment):
    """One call to each internal service, as (name, address, function of a channel)."""
    workers = {w["role"]: w["address"] for w in deployment.workers}
    hello = kpb.SenderMessage(hello=kpb.Hello(protocol_version=1, sender_id="intruder"))
    return [
        (
            "decode worker",
            workers["decode"],
            lambda ch: wpb_grpc.DecodeWorkerStub(ch).Status(wpb.StatusRequest(), timeout=10),
        ),
        (
            "prefill worker",
            workers["prefill"],
            lambda ch: wpb_grpc.PrefillWorkerStub(ch).Status(wpb.StatusRequest(), timeout=10),
        ),
        (
            "KV transfer",
            workers["decode"],
            lambda ch: list(kpb_grpc.KVTransferStub(ch).Pair(iter([hello]), timeout=10)),
        ),
        (
            "registry",
            deployment.internal_address,
            lambda ch: list(
                wpb_grpc.RegistryStub(ch).Register(
                    wpb.WorkerInfo(role="decode", worker_id="intruder", address="127.0.0.1:1"), timeout=10
                )
            ),
        ),
    ]


def test_internal_services_refuse_callers_without_the_cluster_credentials(secure, certs, other_certs):
    wrong_ca = InternalSecurity(
        str(other_certs / "server.pem"),
        str(other_certs / "server.key"),
        str(other_certs / "ca.pem"),
        token=CLUSTER_TOKEN,
    )
    callers = {
        "mTLS, no token": (cluster_member(certs, token=None).channel, grpc.StatusCode.UNAUTHENTICATED),
        "mTLS, wrong token": (cluster_member(certs, token="guess").channel, grpc.StatusCode.UNAUTHENTICATED),
        "TLS without a client certificate": (
            lambda a: ClientSecurity(api_key=CLUSTER_TOKEN, tls_ca=str(certs / "ca.pem")).channel(
                a, [("grpc.ssl_target_name_override", "splitserve-internal")]
            ),
            grpc.StatusCode.UNAVAILABLE,
        ),
        "a certificate of another CA": (wrong_ca.channel, grpc.StatusCode.UNAVAILABLE),
        "plaintext with the token": (lambda a: open_channel(a, token=CLUSTER_TOKEN), grpc.StatusCode.UNAVAILABLE),
    }
    for name, address, call in internal_calls(secure):
        for caller, (channel_to, code) in callers.items():
            with channel_to(address) as channel, pytest.raises(grpc.RpcError) as e:
                call(channel)
            assert e.value.code() == code, f"{caller} -> {name}: {e.value.code()} {e.value.details()}"
            if code == grpc.StatusCode.UNAUTHENTICATED:
                assert "cluster token" in e.value.details()
    with cluster_member(certs).channel(internal_calls(secure)[0][1]) as channel:  # the right credentials pass
        assert wpb_grpc.DecodeWorkerStub(channel).Status(wpb.StatusRequest(), timeout=10).worker_id == "decode-0"
    assert sorted(w["worker_id"] for w in secure.workers) == ["decode-0", "prefill-0"]  # no intruder registered


def test_everything_listens_on_loopback_only(ray_session, secure):
    # By PID: the router's two ports and every worker's are among its processes' listeners, all on loopback.
    listeners = assert_listens_on_loopback_only(secure)
    assert {"router", "decode-0", "prefill-0"} <= set(listeners)
