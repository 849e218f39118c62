"""Tensor parallelism in the engine, on CPU with gloo and real processes (tests/engine/tp_ranks.py).

The same ``LLM.generate`` runs on every rank; in fp32 the ranks' greedy tokens are identical to each
other and, under test_parity's tie rule, to the unsharded engine's and to transformers'. Covered: the
tiny preset and the three architectures' parity models at TP 2 (Llama's one KV head replicated on both
ranks), TP 4 with fewer KV heads than ranks, the checksum equal at every size, sharded loading reading
the right rows and columns, a dead or stalled rank failing the others' collective within the timeout,
and a refused ``tensor_parallel_size``.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.model.config import ModelConfig
from splitserve.engine.model.loader import build_model
from splitserve.engine.tp.distributed import TPGroup, bind_store
from tests.engine import tp_ranks
from tests.engine.parity import assert_greedy_parity, assert_matches, hf_greedy, make_prompts, torch_threads

NEW_TOKENS = 24
TIE_GAP = 1e-3
PROMPT_LENGTHS = [3, 17, 40]
GREEDY = {"max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
SEEDED = {"max_tokens": 16, "temperature": 0.8, "top_p": 0.9, "seed": 11, "ignore_eos": True}
UNSEEDED = {"max_tokens": 16, "temperature": 1.0}  # each rank would draw a seed of its own
CHUNKED = {"prefill_chunk_size": 7, "max_num_batched_tokens": 23}
ARCHS = ["llama", "qwen2", "mistral"]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, arch_model_dirs) -> dict[str, str]:
    return {"tiny": str(tiny_model_dir), **{a: str(arch_model_dirs[a]) for a in ARCHS}}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(2, PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def references(model_dirs, prompts) -> dict[str, dict]:
    """Per model: the unsharded engine's greedy tokens and checksum, and transformers' tokens and gaps."""
    from transformers import AutoModelForCausalLM

    refs = {}
    for name, model_dir in model_dirs.items():
        llm = LLM(model_dir, dtype="float32", block_size=16, num_blocks=256)
        ours = [o.token_ids for o in llm.generate(prompts, SamplingParams(**GREEDY))]
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        refs[name] = {
            "tp1": ours,
            "checksum": llm.weights_checksum,
            "hf": [hf_greedy(hf, p, NEW_TOKENS) for p in prompts],
        }
    return refs


def assert_matches_references(tokens: list[list[int]], ref: dict, what: str) -> None:
    """Under the tie rule: equal to transformers (all but one run tie-free, those in full) and to TP 1."""
    assert_greedy_parity(tokens, ref["hf"], TIE_GAP, len(tokens) - 1, what)
    for i, (ours, tp1, (_, gaps)) in enumerate(zip(tokens, ref["tp1"], ref["hf"])):
        assert_matches(ours, tp1, gaps, TIE_GAP, f"{what} vs TP 1, prompt {i}")


def test_tp2_greedy_matches_tp1_and_transformers(model_dirs, prompts, references):
    runs = [(model_dirs[name], prompts, GREEDY, {}) for name in ["tiny", *ARCHS]]
    runs.append((model_dirs["tiny"], prompts, GREEDY, CHUNKED))
    runs.append((model_dirs["tiny"], prompts, SEEDED, {}))
    runs.append((model_dirs["tiny"], [*prompts, prompts[0]], UNSEEDED, {}))
    ranks = tp_ranks.run_ranks(tp_ranks.generate, 2, runs)
    assert sorted(ranks) == [0, 1]
    for i, name in enumerate(["tiny", *ARCHS, "tiny chunked"]):
        ref = references[name.split()[0]]
        for rank in (0, 1):
            result = ranks[rank][i]
            assert result["in_use"] == 0, f"{name} rank {rank}: blocks left in use"
            assert result["checksum"] == ref["checksum"], f"{name} rank {rank}: checksum differs from TP 1"
        assert ranks[0][i]["tokens"] == ranks[1][i]["tokens"], f"{name}: the ranks disagree"
        assert_matches_references(ranks[0][i]["tokens"], ref, f"{name} TP 2")
    # Seeded sampling draws the same tokens on every rank (identical logits, identical generators).
    assert ranks[0][-2]["tokens"] == ranks[1][-2]["tokens"]
    assert all(len(t) == 16 for t in ranks[0][-2]["tokens"])
    # So does unseeded sampling: rank 0's random seed is every rank's, so the ranks finish each request
    # on the same token (and EOS cannot end it on one rank only); the seeds are random, not one constant.
    unseeded = ranks[0][-1]["tokens"]
    assert unseeded == ranks[1][-1]["tokens"], "unseeded sampling: the ranks disagree"
    assert ranks[0][-1]["in_use"] == ranks[1][-1]["in_use"] == 0
    assert unseeded[0] != unseeded[-1], "the same prompt twice, unseeded: expected different draws"
    # Each rank holds half the query heads; Llama's one KV head is replicated, the others' two are split.
    assert [ranks[r][0]["q_heads"] for r in (0, 1)] == [2, 2]
    assert [ranks[r][i]["kv_heads"] for r in (0, 1) for i in range(4)] == [1] * 8


def test_tp4_with_fewer_kv_heads_than_ranks(model_dirs, prompts, references):
    """Qwen2 (2 KV heads) and Llama (1 KV head) at TP 4: each KV head replicated on 2 and 4 ranks."""
    runs = [(model_dirs[name], prompts, GREEDY, {}) for name in ["qwen2", "llama"]]
    ranks = tp_ranks.run_ranks(tp_ranks.generate, 4, runs, timeout_s=90)
    assert sorted(ranks) == [0, 1, 2, 3]
    for i, name in enumerate(["qwen2", "llama"]):
        tokens = ranks[0][i]["tokens"]
        assert all(ranks[r][i]["tokens"] == tokens for r in range(4)), f"{name}: the ranks disagree"
        assert all(ranks[r][i]["checksum"] == references[name]["checksum"] for r in range(4))
        assert all(ranks[r][i]["kv_heads"] == 1 and ranks[r][i]["q_heads"] == 1 for r in range(4))
        assert_matches_references(tokens, references[name], f"{name} TP 4")


class FakeGroup:
    """A rank's place in a group, for building its shard in this process; it never communicates."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        raise AssertionError("loading must not communicate")


@pytest.mark.parametrize("arch,size", [("llama", 2), ("qwen2", 4), ("mistral", 2)])
def test_sharded_load_reads_each_ranks_rows_and_columns(arch, size, arch_model_dirs):
    """Every rank's qkv, gate_up, o_proj and down_proj are the right slices of the checkpoint (a replicated
    KV head's rows on each of its ranks), row-parallel biases on rank 0 only, and the checksum unchanged."""
    model_dir = arch_model_dirs[arch]
    cfg = ModelConfig.from_model_dir(model_dir)
    _, checksum = build_model(cfg, model_dir, torch.float32, torch.device("cpu"))
    d = cfg.head_dim
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        full = {name: f.get_tensor(name) for name in f.keys()}
    for rank in range(size):
        model, rank_checksum = build_model(cfg, model_dir, torch.float32, torch.device("cpu"), tp=FakeGroup(rank, size))
        assert rank_checksum == checksum
        q_per, inter_per = cfg.num_heads // size, cfg.intermediate_size // size
        kv_head = rank * cfg.num_kv_heads // size  # one KV head per rank in every case here
        q = slice(rank * q_per * d, (rank + 1) * q_per * d)
        kv = slice(kv_head * d, (kv_head + 1) * d)
        inter = slice(rank * inter_per, (rank + 1) * inter_per)
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            qkv = torch.cat(
                [full[p + "self_attn.q_proj.weight"][q], *(full[p + f"self_attn.{n}_proj.weight"][kv] for n in "kv")]
            )
            torch.testing.assert_close(layer.self_attn.qkv_proj.weight, qkv, rtol=0, atol=0)
            if cfg.qkv_bias:
                bias = torch.cat(
                    [full[p + "self_attn.q_proj.bias"][q], *(full[p + f"self_attn.{n}_proj.bias"][kv] for n in "kv")]
                )
                torch.testing.assert_close(layer.self_attn.qkv_proj.bias, bias, rtol=0, atol=0)
            gate_up = torch.cat([full[p + "mlp.gate_proj.weight"][inter], full[p + "mlp.up_proj.weight"][inter]])
            torch.testing.assert_close(layer.mlp.gate_up_proj.weight, gate_up, rtol=0, atol=0)
            torch.testing.assert_close(
                layer.self_attn.o_proj.weight, full[p + "self_attn.o_proj.weight"][:, q], rtol=0, atol=0
            )
            torch.testing.assert_close(
                layer.mlp.down_proj.weight, full[p + "mlp.down_proj.weight"][:, inter], rtol=0, atol=0
            )
        torch.testing.assert_close(model.embed_tokens.weight, full["model.embed_tokens.weight"], rtol=0, atol=0)


def test_row_parallel_bias_on_rank_zero_only(tmp_path, test_tokenizer):
    """A model with o_proj and down_proj biases: rank 0 holds them (added once by the all-reduce), rank 1
    has none, and both load without a bias left unwritten or refused."""
    from splitserve.tools.make_model import write_random_checkpoint
    from tests.conftest import ARCH_CONFIGS

    config = {**ARCH_CONFIGS["llama"], "attention_bias": True, "mlp_bias": True}
    model_dir = write_random_checkpoint(tmp_path / "biased", config, dtype="float32", seed=3, tokenizer=test_tokenizer)
    cfg = ModelConfig.from_model_dir(model_dir)
    rank0, _ = build_model(cfg, model_dir, torch.float32, torch.device("cpu"), tp=FakeGroup(0, 2))
    rank1, _ = build_model(cfg, model_dir, torch.float32, torch.device("cpu"), tp=FakeGroup(1, 2))
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        o_bias = f.get_tensor("model.layers.0.self_attn.o_proj.bias")
    torch.testing.assert_close(rank0.layers[0].self_attn.o_proj.bias, o_bias, rtol=0, atol=0)
    assert rank0.layers[0].mlp.down_proj.bias is not None
    assert rank1.layers[0].self_attn.o_proj.bias is None and rank1.layers[0].mlp.down_proj.bias is None
    assert rank1.layers[0].self_attn.qkv_proj.bias is not None  # column-parallel biases are split, not dropped


def test_dead_rank_fails_the_others_collective_within_the_timeout():
    ranks = tp_ranks.run_ranks(tp_ranks.collectives_then_rank_exits, 2)
    assert sorted(ranks) == [0]  # rank 1 exited without reporting
    result = ranks[0]
    assert result["sum"] == [3.0] and result["broadcast"] == [7.0]
    assert result["error"] is not None and "all_reduce on tensor-parallel rank 0 of 2" in result["error"]
    assert result["elapsed"] < tp_ranks.GROUP_TIMEOUT_S + 2


def test_stalled_rank_fails_the_others_collective_by_the_timeout():
    ranks = tp_ranks.run_ranks(tp_ranks.rank_stalls, 2, group_timeout_s=2.0)
    assert sorted(ranks) == [0]  # the stalled rank exits without reporting
    assert ranks[0]["error"] is not None and "within 2.0s" in ranks[0]["error"]
    assert 1.5 < ranks[0]["elapsed"] < 5.0


def test_tp1_is_the_unsharded_engine(tiny_model_dir, prompts, references):
    """A group of size 1 is dropped: no collective, the whole model, the same tokens bit for bit."""
    store, _ = bind_store("127.0.0.1")
    group = TPGroup.create("gloo", store, "solo/", 0, 1, "127.0.0.1", 5.0, torch.device("cpu"))
    llm = LLM(tiny_model_dir, tp_group=group, dtype="float32", block_size=16, num_blocks=256)
    assert llm.model.tp is None and llm.core.tp_group is None
    assert llm.kv_cache.spec.num_kv_heads == llm.model_config.num_kv_heads
    outputs = llm.generate(prompts, SamplingParams(**GREEDY))
    assert [o.token_ids for o in outputs] == references["tiny"]["tp1"]


@pytest.mark.parametrize(
    "options,field",
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"tensor_parallel_size": 3}, "tensor_parallel_size"),  # 4 heads
        ({"tensor_parallel_size": 8}, "tensor_parallel_size"),  # 8 ranks, 4 heads
        ({"tensor_parallel_size": 2, "tensor_parallel_rank": 2}, "tensor_parallel_rank"),
        ({"tensor_parallel_size": 2}, "tp_group"),  # no group for 2 ranks
    ],
)
def test_bad_tensor_parallel_settings_are_refused_by_name(tiny_model_dir, options, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        LLM(tiny_model_dir, dtype="float32", num_blocks=16, **options)


def test_group_of_another_size_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="^tp_group: rank 0 of 4 does not match"):
        LLM(tiny_model_dir, tp_group=FakeGroup(0, 4), tensor_parallel_size=2, num_blocks=16)
