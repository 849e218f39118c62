"""The OpenAI-compatible API of a served tiny model, through the official ``openai`` client: the same
tokens as the offline engine and the gRPC path, chat templates, usage, streaming, stop strings,
errors, and a client that goes away cancelling its request everywhere."""

from __future__ import annotations

import openai
import pytest
import transformers

from splitserve.client.grpc_client import Client
from tests.serving.conftest import wait_for

GREEDY = {"temperature": 0.0}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is disaggregated serving?"}]


@pytest.fixture(scope="module")
def reference(serving_model):
    from splitserve.engine import LLM

    return LLM(serving_model, dtype="float32", num_blocks=256)


def offline(reference, prompt, **sampling):
    from splitserve.engine import SamplingParams

    return reference.generate([prompt], SamplingParams(**{**GREEDY, **sampling}))[0]


def make_client(deployment, **options) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://{deployment.openai_address}/v1",
        api_key="unused",
        max_retries=0,
        timeout=options.pop("timeout", 60.0),
        **options,
    )


def assert_idle(deployment, timeout_s: float = 5.0) -> None:
    def idle():
        status = Client(deployment.address).status()
        return status.running_requests == 0 and all(w.kv_blocks_in_use == 0 for w in status.workers)

    wait_for(idle, timeout_s=timeout_s)


def test_port_zero_gives_a_free_port_on_loopback(served):
    host, port = served.openai_address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert served.router.openai_address == served.openai_address


def test_models_lists_the_served_model(served, serving_model):
    client = make_client(served)
    models = client.models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [(serving_model.name, "model", "splitserve")]
    assert client.models.retrieve(serving_model.name).id == serving_model.name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_completion_equals_the_offline_engine_and_the_grpc_path(served, serving_model, reference):
    prompt = "The quick brown fox"
    expected = offline(reference, prompt, max_tokens=12, ignore_eos=True)
    registry = served.router.metrics.registry
    generated_before = registry.get_sample_value("splitserve_generation_tokens_total") or 0.0
    response = make_client(served).completions.create(
        model=serving_model.name, prompt=prompt, max_tokens=12, extra_body={"ignore_eos": True}, **GREEDY
    )
    (choice,) = response.choices
    assert choice.text == expected.text and len(set(expected.token_ids)) > 3
    assert (choice.index, choice.finish_reason, response.object) == (0, "length", "text_completion")
    assert response.id.startswith("cmpl-") and response.model == serving_model.name and response.created > 0
    prompt_tokens = len(reference.tokenizer.encode(prompt))
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == (
        prompt_tokens,
        12,
        prompt_tokens + 12,
    )
    timing = choice.model_extra["timing"]  # the router's breakdown, an extra field
    assert timing["first_token_ms"] > 0 and timing["total_ms"] >= timing["first_token_ms"]
    assert timing["prefill_worker"] == "prefill-0" and timing["decode_worker"] == "decode-0"
    # Counted in the router's metrics like a gRPC request (docs/metrics.md).
    assert registry.get_sample_value("splitserve_generation_tokens_total") == generated_before + 12
    with Client(served.address) as grpc_client:
        assert grpc_client.generate(prompt, max_tokens=12, ignore_eos=True, **GREEDY).text == choice.text


def test_streamed_completion_equals_the_whole_one_and_reports_usage_last(served, reference):
    prompt = [5, 17, 99, 1000, 7]
    expected = offline(reference, prompt, max_tokens=16, ignore_eos=True)
    stream = make_client(served).completions.create(
        model=served.router.model_name,
        prompt=prompt,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    chunks = list(stream)
    *text_chunks, last = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert len({c.id for c in chunks}) == 1 and all(c.object == "text_completion" for c in chunks)
    assert all(c.usage is None for c in text_chunks) and len(text_chunks) > 2
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (5, 16)


def test_a_batch_of_prompts_gets_one_choice_each(served, reference):
    prompts = [[1, 2, 3, 4], [900, 800, 700]]
    response = make_client(served).completions.create(
        model=served.router.model_name, prompt=prompts, max_tokens=8, extra_body={"ignore_eos": True}, **GREEDY
    )
    assert [c.index for c in response.choices] == [0, 1]
    assert [c.text for c in response.choices] == [
        offline(reference, p, max_tokens=8, ignore_eos=True).text for p in prompts
    ]
    assert response.choices[0].text != response.choices[1].text
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (7, 16)


def test_n_choices_per_prompt_index_and_usage(served, reference):
    """n choices per prompt, indexed prompt * n + sample (as OpenAI and vLLM); the prompt counted once."""
    prompts = [[1, 2, 3, 4], [900, 800, 700]]
    client = make_client(served)
    response = client.completions.create(
        model=served.router.model_name, prompt=prompts, n=2, max_tokens=8, extra_body={"ignore_eos": True}, **GREEDY
    )
    expected = [offline(reference, p, max_tokens=8, ignore_eos=True).text for p in prompts]
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.text for c in response.choices] == [expected[0], expected[0], expected[1], expected[1]]
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (7, 32)
    sampled = client.completions.create(
        model=served.router.model_name, prompt=prompts[0], n=3, seed=5, max_tokens=8, extra_body={"ignore_eos": True}
    )
    singles = [
        client.completions.create(
            model=served.router.model_name, prompt=prompts[0], seed=5 + i, max_tokens=8, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for i in range(3)
    ]
    assert [c.text for c in sampled.choices] == singles and len(set(singles)) == 3
    chunks = list(
        client.chat.completions.create(
            model=served.router.model_name,
            messages=CHAT,
            n=2,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            **GREEDY,
        )
    )
    texts = ["", ""]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
    assert texts[0] == texts[1] and texts[0]
    assert chunks[-1].usage.completion_tokens == 12
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=served.router.model_name, prompt="Hi", n=2, best_of=3)
    assert (e.value.param, e.value.code) == ("best_of", "unsupported_parameter")
    assert len(client.completions.create(model=served.router.model_name, prompt="Hi", n=2, best_of=2).choices) == 2
    assert_idle(served)


def test_chat_completion_renders_the_checkpoint_template(served, serving_model, reference):
    hf = transformers.AutoTokenizer.from_pretrained(serving_model)
    prompt_ids = hf.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    expected = offline(reference, prompt_ids, max_tokens=10, ignore_eos=True)
    client = make_client(served)
    response = client.chat.completions.create(
        model=serving_model.name, messages=CHAT, max_completion_tokens=10, extra_body={"ignore_eos": True}, **GREEDY
    )
    (choice,) = response.choices
    assert (choice.message.role, choice.message.content) == ("assistant", expected.text)
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt_ids), 10)

    chunks = list(
        client.chat.completions.create(
            model=serving_model.name,
            messages=CHAT,
            max_tokens=10,
            stream=True,
            extra_body={"ignore_eos": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_cached_tokens_on_a_repeated_prefix(served):
    client = make_client(served)
    prompt = list(range(300, 364))  # four blocks of 16
    first = client.completions.create(model=served.router.model_name, prompt=prompt, max_tokens=2, **GREEDY)
    second = client.completions.create(model=served.router.model_name, prompt=prompt, max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 48


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_end_the_text_before_them(served, reference, stream):
    prompt = "Once upon a time"
    full = offline(reference, prompt, max_tokens=24, ignore_eos=True).text
    stop = full[8:11]
    assert stop.strip() and full.index(stop) == 8
    create = make_client(served).completions.create
    args = dict(
        model=served.router.model_name, prompt=prompt, max_tokens=24, stop=[stop], extra_body={"ignore_eos": True}
    )
    if stream:
        chunks = list(create(stream=True, **args, **GREEDY))
        text, finished = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0]
    else:
        finished = create(**args, **GREEDY).choices[0]
        text = finished.text
    assert text == full[:8]
    assert (finished.finish_reason, finished.model_extra["stop_reason"]) == ("stop", stop)


def test_errors_in_openai_shape(served):
    client = make_client(served)
    name = served.router.model_name
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=name, prompt="Hi", temperature=-1.0)
    assert e.value.param == "temperature" and e.value.code == "invalid_value"
    assert e.value.body["message"].startswith("temperature: must be >= 0")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=name, messages=CHAT, max_completion_tokens=100000)
    assert (e.value.param, e.value.code) == ("max_completion_tokens", "context_length_exceeded")
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert (e.value.param, e.value.code) == ("model", "model_not_found")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=name, prompt="Hi", n=17)
    assert (e.value.param, e.value.code) == ("n", "invalid_value")
    assert e.value.body["message"].startswith("n: must be 1 to 16")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=name, prompt=[[]])
    assert e.value.param == "prompt"
    assert_idle(served)


def test_closing_a_stream_cancels_the_request_everywhere(served):
    client = make_client(served)
    name = served.router.model_name
    stream = client.completions.create(
        model=name,
        prompt=list(range(1, 40)),
        max_tokens=3000,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": "long-one"},
        **GREEDY,
    )
    received = [next(stream) for _ in range(3)]  # decoding: 3000 tokens would take 30 s or more
    assert all(c.choices[0].text is not None for c in received)
    assert Client(served.address).status().running_requests == 1
    with pytest.raises(openai.ConflictError) as e:  # the id is in flight
        client.completions.create(model=name, prompt="Hi", extra_headers={"X-Request-Id": "long-one"})
    assert e.value.body["message"].startswith("X-Request-Id:")
    assert e.value.response.headers["x-should-retry"] == "false"  # the client would retry a 409 otherwise
    stream.close()
    assert_idle(served)


def test_a_client_timing_out_cancels_a_whole_response_request(served):
    client = make_client(served, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(
            model=served.router.model_name, prompt="Hello", max_tokens=3000, extra_body={"ignore_eos": True}, **GREEDY
        )
    assert_idle(served)
