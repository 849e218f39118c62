"""Bad input, table-driven: every malformed request gets INVALID_ARGUMENT with a message naming the
field, a duplicate in-flight request_id gets ALREADY_EXISTS, and the server stays healthy: a good
request still works afterwards and no worker holds a KV block. The same table is in
docs/serving.md (Errors)."""

from __future__ import annotations

import grpc
import pytest

from splitserve.client.grpc_client import Client, make_request
from splitserve.v1 import splitserve_pb2 as pb
from splitserve.v1 import splitserve_pb2_grpc as pb_grpc
from tests.serving.conftest import start_deployment, wait_for
from tests.threads import Background

VOCAB, CONTEXT = 2048, 4096  # the tiny preset

# (case, request fields, the field its message must name). A negative max_tokens cannot be sent:
# the field is a uint32 in the proto.
CASES = [
    ("empty prompt", dict(prompt=""), "prompt"),
    ("neither prompt nor token_ids", dict(), "prompt, token_ids"),
    ("both prompt and token_ids", dict(prompt="hi", token_ids=[1, 2]), "prompt, token_ids"),
    ("token id past the vocabulary", dict(token_ids=[1, VOCAB]), "token_ids"),
    ("prompt + max_tokens past the context", dict(token_ids=[1] * 100, max_tokens=CONTEXT), "sampling.max_tokens"),
    ("max_tokens 0", dict(token_ids=[1, 2], max_tokens=0), "sampling.max_tokens"),
    ("max_tokens absurd", dict(token_ids=[1, 2], max_tokens=2**31 - 1), "sampling.max_tokens"),
    ("temperature negative", dict(token_ids=[1, 2], temperature=-0.5), "sampling.temperature"),
    ("temperature NaN", dict(token_ids=[1, 2], temperature=float("nan")), "sampling.temperature"),
    ("top_p 0", dict(token_ids=[1, 2], top_p=0.0), "sampling.top_p"),
    ("top_p above 1", dict(token_ids=[1, 2], top_p=1.5), "sampling.top_p"),
    ("top_k below -1", dict(token_ids=[1, 2], top_k=-2), "sampling.top_k"),
    ("min_p negative", dict(token_ids=[1, 2], min_p=-0.1), "sampling.min_p"),
    ("min_p above 1", dict(token_ids=[1, 2], min_p=1.5), "sampling.min_p"),
    ("too many stop strings", dict(token_ids=[1, 2], stop=[f"s{i}" for i in range(17)]), "sampling.stop"),
    ("a stop string too long", dict(token_ids=[1, 2], stop=["x" * 257]), "sampling.stop"),
    ("stop token id past the vocabulary", dict(token_ids=[1, 2], stop_token_ids=[VOCAB]), "sampling.stop_token_ids"),
    ("request_id too long", dict(token_ids=[1, 2], request_id="r" * 129), "request_id"),
    ("logprobs above 20", dict(token_ids=[1, 2], logprobs=21), "sampling.logprobs"),
    ("prompt_logprobs above 20", dict(token_ids=[1, 2], prompt_logprobs=21), "sampling.prompt_logprobs"),
]


@pytest.fixture(scope="module")
def served(ray_session, serving_model):
    deployment = start_deployment(serving_model, faults={"decode_step_delay_s": 0.01})
    yield deployment
    deployment.stop()


def call(address: str, message: pb.GenerateRequest) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as e:
        list(pb_grpc.SplitServeStub(channel).Generate(message, timeout=10))
    return e.value


@pytest.mark.parametrize("case, fields, field", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_invalid_argument_naming_the_field(served, case, fields, field):
    fields = dict(fields)
    message = make_request(
        fields.pop("prompt", None), fields.pop("token_ids", None), fields.pop("request_id", None), **fields
    )
    error = call(served.address, message)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, error.details())
    assert error.details().startswith(f"{field}:"), (case, error.details())


def test_a_request_over_the_size_limit_is_refused_without_harm(served):
    limit = 4 << 20  # router.max_message_bytes
    error = call(served.address, make_request("a" * (limit + 1000), max_tokens=2))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("prompt:"), error.details()
    assert str(limit) in error.details()
    error = call(served.address, make_request(token_ids=[300] * (limit // 2 + 10), max_tokens=2))  # 2 bytes an id
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("token_ids:"), (
        error.details()
    )
    # Far past it, the transport refuses it unread.
    error = call(served.address, make_request("a" * (3 * limit), max_tokens=2))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()


def test_a_duplicate_in_flight_request_id_is_already_exists(served):
    with Client(served.address) as client:

        def first() -> int:
            return len(
                client.generate(token_ids=[1, 2, 3], request_id="dup", max_tokens=200, ignore_eos=True).token_ids
            )

        running = Background(first)
        wait_for(lambda: "dup" in served.router.inflight, 20, 0.02)
        error = call(served.address, make_request(token_ids=[4, 5], request_id="dup", max_tokens=2))
        assert not running.done(), "the first request must still be in flight when the duplicate arrives"
        assert running.result(60) == 200, "the first request is unharmed by the refused duplicate"
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS and error.details().startswith("request_id:")


def test_after_all_of_it_the_server_serves_and_holds_no_block(served):
    with Client(served.address) as client:
        assert len(client.generate(token_ids=[1, 2, 3], max_tokens=5, temperature=0.0).token_ids) == 5
    wait_for(lambda: all(w.kv_blocks_in_use == 0 for w in Client(served.address).status().workers), 10)
