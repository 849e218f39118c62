"""The one request error: its codes are gRPC's status names, and each becomes the status of that name."""

from __future__ import annotations

import pickle
import subprocess
import sys

import grpc
import pytest

from splitserve.common.errors import STATUS_NAMES, ServingError
from splitserve.router.openai.errors import OpenAIError
from splitserve.rpc.status import abort, from_status, status_code


def test_the_names_are_grpcs_less_ok():
    assert STATUS_NAMES == {code.name for code in grpc.StatusCode} - {"OK"}


@pytest.mark.parametrize("name", sorted(STATUS_NAMES))
def test_each_code_maps_to_the_grpc_status_of_that_name(name):
    error = ServingError(name, "request_id: something")
    assert status_code(error) is getattr(grpc.StatusCode, name)
    assert str(error) == error.message == "request_id: something"
    back = from_status(status_code(error), "request_id: something")
    assert (back.code, back.message) == (name, "request_id: something")


@pytest.mark.parametrize("bad", ["OK", "invalid_argument", "BAD_REQUEST", ""])
def test_a_code_that_is_not_a_status_name_is_refused(bad):
    with pytest.raises(ValueError, match="code: .* is not a gRPC status name"):
        ServingError(bad, "message")


def test_it_pickles_with_its_code():
    error = pickle.loads(pickle.dumps(ServingError("RESOURCE_EXHAUSTED", "the queue is full")))
    assert (error.code, error.message) == ("RESOURCE_EXHAUSTED", "the queue is full")


def test_missing_details_become_an_empty_message():
    assert from_status(grpc.StatusCode.UNAVAILABLE, None).message == ""


class _Context:
    """Records ``abort`` and raises, as grpc's servicer context does."""

    def abort(self, code, details):
        self.aborted = (code, details)
        raise RuntimeError("aborted")


def test_abort_ends_the_call_with_the_errors_status():
    context = _Context()
    with pytest.raises(RuntimeError, match="aborted"):
        abort(context, ServingError("ALREADY_EXISTS", "request_id: 'a' is already here"))
    assert context.aborted == (grpc.StatusCode.ALREADY_EXISTS, "request_id: 'a' is already here")


@pytest.mark.parametrize(
    "name, status", [("INVALID_ARGUMENT", 400), ("RESOURCE_EXHAUSTED", 429), ("UNAVAILABLE", 503), ("INTERNAL", 500)]
)
def test_the_openai_front_end_maps_the_same_error_to_http(name, status):
    error = OpenAIError.from_error(ServingError(name, "why"))
    assert (error.status, error.message) == (status, "why")


def test_the_common_layer_imports_neither_grpc_nor_torch():
    code = (
        "import sys, splitserve.common.errors, splitserve.common.arith;"
        "print('grpc' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
