from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models

from splitserve.engine.text.detokenizer import NUM_PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer
from splitserve.engine.text.tokenizer import Tokenizer
from tests.engine.tokenizer_fixtures import SPECIAL_TOKENS, make_byte_level_backend, make_byte_level_tokenizer_dir

SPECIAL_TEXT = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))

# Characters that the test tokenizer splits into several byte tokens, plus merged multi-byte ones.
MULTI_BYTE = ["🦜", "🫠", "𝄞", "龘", "🚀", "👍🏽", "你好", "é", "\ufffd", "Привет"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_model_dir(make_byte_level_tokenizer_dir(tmp_path_factory.mktemp("tok")))


def stream(detokenizer: IncrementalDetokenizer, chunks: Sequence[Sequence[int]]) -> list[str]:
    """Every piece of text emitted for `chunks`, the flush included as the last piece."""
    return [detokenizer.add_tokens(chunk) for chunk in chunks] + [detokenizer.flush()]


def chop(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])]


def test_character_split_across_tokens_is_emitted_whole(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🦜")
    assert len(ids) == 3
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.add_tokens([i]) for i in ids] == ["", "", "🦜"]
    assert detokenizer.flush() == ""
    assert detokenizer.text == "🦜"
    assert detokenizer.token_ids == ids


def test_flush_emits_an_incomplete_character_as_decoded(tokenizer: Tokenizer) -> None:
    ok, clef = tokenizer.encode("ok"), tokenizer.encode(" 𝄞")[:-1]
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add_tokens(ok) == "ok"
    # A batch is held as a whole while its text ends in a partial character.
    assert detokenizer.add_tokens(clef) == ""
    assert detokenizer.flush() == tokenizer.decode(clef) == " \ufffd"
    assert detokenizer.text == "ok \ufffd"


def test_add_tokens_after_flush_raises(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer)
    detokenizer.add_tokens(tokenizer.encode("hi"))
    detokenizer.flush()
    assert detokenizer.flush() == ""
    with pytest.raises(RuntimeError, match="flush"):
        detokenizer.add_tokens([5])


@pytest.mark.parametrize("skip_special_tokens, expected", [(True, "hi there"), (False, "hi<|im_end|> there")])
def test_special_tokens(tokenizer: Tokenizer, skip_special_tokens: bool, expected: str) -> None:
    ids = tokenizer.encode("hi<|im_end|> there")
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    assert "".join(stream(detokenizer, [[i] for i in ids])) == expected


def test_prompt_ending_inside_a_character_does_not_shift_output(tokenizer: Tokenizer) -> None:
    parrot = tokenizer.encode("🦜")
    output = parrot[2:] + tokenizer.encode("A")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=tokenizer.encode("x") + parrot[:2])
    assert "".join(stream(detokenizer, [[i] for i in output])) == tokenizer.decode(output)


def test_prompt_context_keeps_leading_space_of_sentencepiece_tokens() -> None:
    # Metaspace (SentencePiece) decoding drops the "▁" of the first token, so each new token must be
    # decoded after some context or every word would lose its space.
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁again": 3, "!": 4, "<sep>": 5}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    backend.add_special_tokens(["<sep>"])
    tokenizer = Tokenizer(backend)
    assert tokenizer.decode([2]) == "world"

    with_prompt = IncrementalDetokenizer(tokenizer, prompt_token_ids=[1])
    assert stream(with_prompt, [[2], [3], [4]]) == [" world", " again", "!", ""]
    without_prompt = IncrementalDetokenizer(tokenizer)
    assert stream(without_prompt, [[2], [3], [4]]) == ["world", " again", "!", ""]
    # A skipped special token decodes to nothing; the word after it still needs the context before it.
    across_special = IncrementalDetokenizer(tokenizer, prompt_token_ids=[1])
    assert stream(across_special, [[5], [2]]) == ["", " world", ""]


def test_decode_window_stays_small(tokenizer: Tokenizer) -> None:
    windows: list[int] = []

    class CountingTokenizer(Tokenizer):
        def decode(self, token_ids, skip_special_tokens=True):  # type: ignore[override]
            token_ids = list(token_ids)
            windows.append(len(token_ids))
            return super().decode(token_ids, skip_special_tokens)

    counting = CountingTokenizer(make_byte_level_backend())
    text = "The quick brown fox 🦜 jumps over the lazy dog. 你好，世界 𝄞 " * 20
    ids = counting.encode(text)
    assert len(ids) > 300
    detokenizer = IncrementalDetokenizer(counting, prompt_token_ids=ids[:100])
    assert "".join(stream(detokenizer, [[i] for i in ids])) == text
    assert max(windows) <= NUM_PROMPT_CONTEXT_TOKENS + 4


@functools.cache
def byte_level_backend() -> BackendTokenizer:
    return make_byte_level_backend()


def encode_ids(text: str) -> list[int]:
    return byte_level_backend().encode(text).ids


piece_ids = st.one_of(
    st.lists(st.integers(0, 499), max_size=4),  # anything, invalid UTF-8 and special tokens included
    st.sampled_from(MULTI_BYTE).map(encode_ids),
    st.text(max_size=4).map(encode_ids),
)


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(piece_ids, max_size=12).map(lambda pieces: [i for p in pieces for i in p]),
    num_prompt_ids=st.integers(0, 1000),
    cuts=st.lists(st.integers(0, 1000), max_size=8),
    skip_special_tokens=st.booleans(),
)
def test_streamed_text_equals_full_decode(
    tokenizer: Tokenizer, ids: list[int], num_prompt_ids: int, cuts: list[int], skip_special_tokens: bool
) -> None:
    # Splitting one sequence into prompt and output also splits characters across the two.
    split = num_prompt_ids % (len(ids) + 1)
    prompt, output = ids[:split], ids[split:]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    pieces = stream(detokenizer, chop(output, cuts))
    assert "".join(pieces) == tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
    assert detokenizer.text == "".join(pieces)
    assert detokenizer.token_ids == output


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\ufffd"), max_size=30),
    prompt=st.text(max_size=10),
)
# A special token's text encodes to that token, which the detokenizer skips by default.
@example(text="<|im_end|>", prompt="")
@example(text="a<|im_start|>b<|im_end|>", prompt="<|endoftext|>")
def test_valid_text_never_streams_a_replacement_character(tokenizer: Tokenizer, text: str, prompt: str) -> None:
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt))
    pieces = stream(detokenizer, [[i] for i in ids])
    assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(pieces) == SPECIAL_TEXT.sub("", text)
