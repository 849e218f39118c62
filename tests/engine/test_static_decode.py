"""The static-shape decode path equals the dynamic one token for token (fp32, greedy), and its CUDA-graph
bookkeeping replays what it captured.

Each model (the tiny preset; Llama, Qwen2 with a sliding-window layer, Mistral with a window on every
layer) runs once per path on the same requests. Batches shrink one request at a time (different
``max_tokens``), so the decode steps cross every bucket edge; more requests than ``max_num_seqs`` and a
small cache make later requests reuse blocks that earlier ones freed; contexts pass the windows (24).
The dynamic path is the one tests/engine/test_parity*.py hold to transformers.

On a CPU, CUDA graphs are exercised with a fake graph backend (tests/engine/fake_graphs.py) that records
the captured operators with the tensors they read and wrote, and replays those operators on those tensors,
as a real graph replays its kernels on the captured addresses: a runner whose inputs reach the forward by
any other way than the persistent buffers decodes wrongly under it (the real capture is skipped: "needs
CUDA").
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.core import EngineConfig
from splitserve.engine.runner.static_decode import batch_buckets
from tests.engine.fake_graphs import FakeGraphBackend
from tests.engine.parity import assert_no_blocks_in_use, make_prompts, torch_threads

MAX_NUM_SEQS = 8
ENGINE = dict(dtype="float32", block_size=4, num_blocks=120, max_model_len=96, max_num_seqs=MAX_NUM_SEQS)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def model_dirs(arch_model_dirs, tiny_model_dir):
    return {"tiny": tiny_model_dir, **arch_model_dirs}


def make_llm(model_dir, path: str, **options) -> LLM:
    return LLM(model_dir, decode_path=path, **{**ENGINE, **options})


class Recorder:
    """Wraps the static path's ``fill``: the bucket and batch of every static step, and which requests'
    tables held each block."""

    def __init__(self, llm: LLM) -> None:
        self.steps: list[tuple[int, int]] = []
        self.block_users: dict[int, set[str]] = {}
        static = llm.runner.static
        fill = static.fill

        def recording_fill(items, tables):
            bucket = fill(items, tables)
            self.steps.append((len(items), bucket))
            for item, table in zip(items, tables):
                for block in table:
                    self.block_users.setdefault(block, set()).add(item.request.request_id)
            return bucket

        static.fill = recording_fill


def run(llm: LLM, prompts, max_tokens) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("name", ["tiny", "llama", "qwen2", "mistral"])
def test_static_equals_dynamic_token_for_token(name, model_dirs):
    # 48 blocks of 4 tokens: fewer than the 11 requests need in all, so later ones reuse freed blocks.
    dynamic = make_llm(model_dirs[name], "dynamic", num_blocks=48)
    static = make_llm(model_dirs[name], "static", num_blocks=48)
    recorder = Recorder(static)
    # 11 requests for 8 slots; lengths across block edges (block_size 4) and past the window of 24.
    prompts = make_prompts(5, [1, 3, 4, 5, 9, 16, 23, 30, 41, 2, 12])
    max_tokens = [20, 3, 12, 26, 7, 16, 9, 30, 14, 5, 18]
    expected = run(dynamic, prompts, max_tokens)
    assert run(static, prompts, max_tokens) == expected
    # Not degenerate: (a 1-token prompt may repeat itself, so the check is over the whole batch)
    assert len({tuple(out) for out in expected}) == len(expected) and len({t for out in expected for t in out}) > 60
    assert dynamic.runner.steps["static"] == 0 and static.runner.steps["static"] > 20
    batches = Counter(batch for batch, _ in recorder.steps)
    assert set(batches) >= {1, 2, 3, 4, 5, MAX_NUM_SEQS}, batches  # bucket edges and padded batches
    assert all(bucket == min(b for b in batch_buckets(MAX_NUM_SEQS) if b >= n) for n, bucket in recorder.steps)
    reused = [b for b, users in recorder.block_users.items() if len(users) > 1]
    assert reused, "no block served two requests: the test would not see stale block-table entries"
    assert max(n + len(out) for n, out in zip(map(len, prompts), expected)) > 24  # contexts pass the window
    for llm in (dynamic, static):
        assert_no_blocks_in_use(llm)


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, MAX_NUM_SEQS])
def test_each_batch_size_at_the_bucket_edges(batch, model_dirs):
    """All requests decode together for the whole run: the batch stays at ``batch`` (padded to its bucket)."""
    dynamic, static = make_llm(model_dirs["mistral"], "dynamic"), make_llm(model_dirs["mistral"], "static")
    recorder = Recorder(static)
    prompts = make_prompts(batch, [3 + 7 * i for i in range(batch)])
    assert run(static, prompts, [12] * batch) == run(dynamic, prompts, [12] * batch)
    assert {n for n, _ in recorder.steps} == {batch} and len(recorder.steps) == 11


def test_padding_rows_write_only_the_scratch_block(model_dirs):
    llm = make_llm(model_dirs["tiny"], "static")
    scratch = llm.blocks.num_blocks
    assert llm.kv_cache.spec.num_blocks == scratch + 1  # one block past those the manager hands out
    for prompt in make_prompts(9, [5, 8, 2]):
        llm.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    llm.step()  # the prefill
    output = llm.scheduler.schedule()  # 3 decodes: bucket 4, one padding row
    slots = set()
    for item in output.scheduled:
        position = item.request.num_computed_tokens
        slots.add((llm.blocks.block_table(item.request.request_id)[position // 4], position % 4))
    before = llm.kv_cache.tensor.clone()
    llm.scheduler.update(output, llm.runner.execute(output))
    assert llm.runner.steps["static"] == 1
    changed = (llm.kv_cache.tensor != before).any(dim=(0, 2, 3, 5)).nonzero().tolist()  # [(block, offset)]
    assert {tuple(c) for c in changed if c[0] != scratch} == slots
    assert any(c[0] == scratch for c in changed)


def test_mixed_and_prefill_steps_stay_dynamic(model_dirs):
    llm = make_llm(model_dirs["tiny"], "static", max_num_batched_tokens=16, prefill_chunk_size=8)
    prompts = make_prompts(3, [30, 4])
    dynamic = make_llm(model_dirs["tiny"], "dynamic", max_num_batched_tokens=16, prefill_chunk_size=8)
    expected = run(dynamic, prompts, [6, 6])
    assert run(llm, prompts, [6, 6]) == expected
    # 4 chunks of the long prompt run with the short one's decodes (dynamic); then only decodes.
    assert 0 < llm.runner.steps["static"] < 6 + 6 and llm.runner.steps["dynamic"] >= 4


def test_decode_path_setting():
    with pytest.raises(ValueError, match="decode_path"):
        EngineConfig(model_dir="m", decode_path="fast")
    assert EngineConfig(model_dir="m").decode_path == "auto"


def test_auto_is_dynamic_on_cpu_and_graphs_stay_off(model_dirs):
    llm = LLM(model_dirs["tiny"], dtype="float32", num_blocks=32)
    assert llm.runner.static is None and llm.kv_cache.spec.num_blocks == 32
    static = make_llm(model_dirs["tiny"], "static", cuda_graphs=True)
    assert static.runner.graphs is None and static.core.decode_graphs == ""


def test_buckets():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)


# ---- CUDA graphs ---------------------------------------------------------------------------------


def test_graph_capture_order_pool_and_replay(model_dirs):
    dynamic, static = make_llm(model_dirs["qwen2"], "dynamic"), make_llm(model_dirs["qwen2"], "static")
    backend = FakeGraphBackend()
    stats = static.runner.capture_decode_graphs(backend)
    graphs = static.runner.graphs.graphs
    assert [graphs[b] for b in (8, 4, 2, 1)] == [g for g, _ in backend.captured]  # largest first
    first = backend.captured[0][0]
    assert [pool for _, pool in backend.captured] == [None] + [("pool of", first)] * 3  # one shared pool
    assert stats.buckets == (1, 2, 4, 8) and stats.memory_bytes == 12 << 20
    assert stats.summary().startswith("4 graphs (batch 1-8), captured in ") and stats.summary().endswith("12.0 MiB")
    assert all(g.replays == 0 for g in graphs.values())
    prompts = make_prompts(11, [3, 17, 30, 8, 25])
    max_tokens = [16, 4, 10, 12, 8]
    assert run(static, prompts, max_tokens) == run(dynamic, prompts, max_tokens)
    replays = {b: g.replays for b, g in graphs.items()}
    assert sum(replays.values()) == static.runner.steps["graph"] and replays[8] > 0 and replays[1] > 0
    assert static.runner.steps["static"] == 0, "every static step replayed its bucket's graph"
    assert_no_blocks_in_use(static)


def rebind_inputs_each_step(llm: LLM) -> None:
    """A runner with a bug that only a graph shows: every fill first puts new tensors in place of the
    persistent input buffers (and metadata views on them) instead of refilling the old ones in place."""
    inputs = llm.runner.static
    fill, paged_decode = inputs.fill, inputs.meta[inputs.buckets[0]].paged_decode

    def rebinding_fill(items, tables):
        inputs.scalars, inputs.block_tables = inputs.scalars.clone(), inputs.block_tables.clone()
        inputs._host_scalars, inputs._host_tables = inputs.scalars, inputs.block_tables  # on the CPU, the same
        inputs.meta = {b: inputs._metadata(b, paged_decode) for b in inputs.buckets}
        return fill(items, tables)

    inputs.fill = rebinding_fill


def test_graphs_replay_the_captured_buffers_so_inputs_that_moved_go_stale(model_dirs):
    """The fake's replay reads the tensors the capture read, as a real graph does: with the input buffers
    rebound after capture, eager static decoding is still right, and the graphs decode on the stale
    buffers (the capture's padding) and go wrong. A fake that reran the forward would see the new
    tensors and hide the bug."""
    prompts, max_tokens = make_prompts(13, [5, 12, 7]), [8, 8, 8]
    expected = run(make_llm(model_dirs["tiny"], "dynamic"), prompts, max_tokens)
    eager = make_llm(model_dirs["tiny"], "static")
    rebind_inputs_each_step(eager)
    assert run(eager, prompts, max_tokens) == expected and eager.runner.steps["static"] > 0
    graphed = make_llm(model_dirs["tiny"], "static")
    graphed.runner.capture_decode_graphs(FakeGraphBackend())
    rebind_inputs_each_step(graphed)
    got = run(graphed, prompts, max_tokens)
    assert graphed.runner.steps["graph"] > 0
    assert [out[0] for out in got] == [out[0] for out in expected], "first tokens come from the (dynamic) prefill"
    assert got != expected, "the replay read the rebound buffers: the fake does not replay what it captured"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_cuda_graphs_equal_the_eager_paths(model_dirs):
    cuda = dict(device="cuda", dtype="float32")
    graphed = make_llm(model_dirs["mistral"], "static", cuda_graphs=True, **cuda)
    eager = make_llm(model_dirs["mistral"], "dynamic", **cuda)
    assert graphed.core.graph_stats is not None and "graphs (batch 1-8)" in graphed.core.decode_graphs
    prompts = make_prompts(12, [3, 17, 30, 8, 25])
    max_tokens = [16, 4, 10, 12, 8]
    assert run(graphed, prompts, max_tokens) == run(eager, prompts, max_tokens)
    assert graphed.runner.steps["graph"] > 0 and graphed.runner.steps["static"] == 0
