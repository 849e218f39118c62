"""Log lines as text or JSON, the request id on every line about a request, and the router's one
line per request."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading

import pytest

from splitserve.observability.logs import configure_logging, make_handler, request_context
from splitserve.router.metrics import RequestSummary, log_request
from splitserve.v1 import splitserve_pb2 as pb
from tests.observability.capture import json_log_lines


@pytest.fixture()
def capture():
    """Lines written through a handler of the given format, on a private logger."""
    made = []

    def make(log_format: str, static=None) -> tuple[logging.Logger, io.StringIO]:
        stream = io.StringIO()
        logger = logging.getLogger(f"splitserve.test.{len(made)}")
        logger.propagate = False
        logger.setLevel(logging.DEBUG)
        logger.addHandler(make_handler(log_format, static, stream))
        made.append(logger)
        return logger, stream

    yield make
    for logger in made:
        logger.handlers.clear()


def json_lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_the_request_id_from_the_context(capture):
    logger, stream = capture("json", static={"worker_id": "decode-1", "role": "decode"})
    logger.info("before")
    with request_context("req-7"):
        logger.warning("lease for %s refused", "req-7")
        with request_context("req-8"):
            logger.info("nested")
        logger.info("still %d", 7, extra={"blocks": 3})
    logger.info("explicit", extra={"request_id": "req-9"})
    lines = json_lines(stream)
    assert [line.get("request_id") for line in lines] == [None, "req-7", "req-8", "req-7", "req-9"]
    assert lines[1]["message"] == "lease for req-7 refused" and lines[1]["level"] == "WARNING"
    assert lines[3]["blocks"] == 3 and lines[3]["message"] == "still 7"
    assert all(line["worker_id"] == "decode-1" and line["role"] == "decode" for line in lines)
    assert all(line["time"].endswith("Z") and line["logger"].startswith("splitserve.test") for line in lines)


def test_each_task_and_thread_keeps_its_own_request_id(capture):
    logger, stream = capture("json")

    async def call(request_id: str) -> None:
        with request_context(request_id):
            await asyncio.sleep(0.01)
            await asyncio.create_task(asyncio.sleep(0))  # tasks it starts inherit the id
            logger.info("relay")

    async def main() -> None:
        await asyncio.gather(*(call(f"r{i}") for i in range(5)))

    asyncio.run(main())

    def handle(request_id: str) -> None:
        with request_context(request_id):
            logger.info("handled")

    threads = [threading.Thread(target=handle, args=(f"t{i}",)) for i in range(3)]
    for t in threads:
        t.start()
        t.join(5)
        assert not t.is_alive()
    logger.info("main thread")
    ids = [line.get("request_id") for line in json_lines(stream)]
    assert sorted(ids[:5]) == [f"r{i}" for i in range(5)] and sorted(ids[5:8]) == ["t0", "t1", "t2"]
    assert ids[8] is None


def test_exceptions_and_text_format(capture):
    logger, stream = capture("json")
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("failed")
    assert "ValueError: boom" in json_lines(stream)[0]["exception"]
    text_logger, text = capture("text")
    with request_context("req-1"):
        text_logger.info("hello", extra={"ignored": 1})
    assert text.getvalue().rstrip().endswith("splitserve.test.1 INFO hello")
    with pytest.raises(ValueError, match="log_format"):
        make_handler("yaml")


def test_configure_logging_replaces_only_its_own_handler():
    root = logging.getLogger()
    level, foreign = root.level, logging.NullHandler()
    root.addHandler(foreign)
    try:
        configure_logging("json")
        configure_logging("text")
        ours = [h for h in root.handlers if getattr(h, "_splitserve", False)]
        assert len(ours) == 1 and foreign in root.handlers and root.level == logging.INFO
    finally:
        for h in [h for h in root.handlers if getattr(h, "_splitserve", False)] + [foreign]:
            root.removeHandler(h)
        root.setLevel(level)


def test_the_request_line_has_the_timing_as_text_and_fields():
    timing = pb.Timing(
        queue_ms=1.23456,
        prefill_ms=20.0,
        transfer_ms=3.0,
        first_token_ms=21.2,
        decode_ms=99.5,
        total_ms=121.0,
        prefill_worker="prefill-0",
        decode_worker="decode-1",
        reprefills=1,
    )
    with json_log_lines("splitserve.requests") as lines:
        log_request(RequestSummary("req-1", "finished", "OK", "", "stop", 12, 5, 8, timing))
        log_request(
            RequestSummary("req-2", "error", "UNAVAILABLE", "no decode worker had room", "", 3, 0, 0, pb.Timing())
        )
        log_request(RequestSummary("-", "error", "INVALID_ARGUMENT", "prompt: must not be empty", "", 0, 0, 0, None))
        done, failed, refused = lines()
    assert done["request_id"] == "req-1" and done["queue_ms"] == 1.235 and done["reprefills"] == 1
    assert (done["prompt_tokens"], done["completion_tokens"], done["cached_tokens"]) == (12, 5, 8)
    assert done["message"].startswith("request req-1 finished outcome=finished status=OK finish_reason=stop")
    assert "decode_worker=decode-1" in done["message"] and done["level"] == "INFO"
    assert failed["level"] == "WARNING" and failed["error"] == "no decode worker had room"
    assert failed["message"].endswith(": no decode worker had room")
    assert refused["level"] == "INFO" and "queue_ms" not in refused and refused["status"] == "INVALID_ARGUMENT"
