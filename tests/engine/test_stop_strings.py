from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.engine.text.stop_strings import StopStringMatcher


def run(matcher: StopStringMatcher, deltas: Sequence[str]) -> tuple[list[str], str | None]:
    """Feeds `deltas` until a match, as a request loop would; returns every emitted piece (the flush
    included as the last piece) and the matched stop string."""
    pieces: list[str] = []
    for delta in deltas:
        emitted, matched = matcher.feed(delta)
        pieces.append(emitted)
        if matched is not None:
            assert matcher.matched == matched
            break
    pieces.append(matcher.flush())
    return pieces, matcher.matched


def test_stop_split_across_one_character_deltas_never_reaches_the_client() -> None:
    matcher = StopStringMatcher(["<|end|>"])
    pieces, matched = run(matcher, list("Hi <|end|> ignored"))
    assert matched == "<|end|>"
    assert "".join(pieces) == "Hi "
    assert all(piece in ("", "H", "i", " ") for piece in pieces)


def test_held_text_is_released_once_it_cannot_become_a_stop() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abcST") == ("abc", None)
    assert matcher.feed("O") == ("", None)
    assert matcher.feed("P!") == ("", "STOP")
    assert matcher.flush() == ""

    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abcST") == ("abc", None)
    assert matcher.feed("Ox") == ("STOx", None)
    assert matcher.feed("ST") == ("", None)
    assert matcher.flush() == "ST"


def test_overlapping_stops_earliest_start_wins() -> None:
    assert run(StopStringMatcher(["ab", "b"]), ["xa", "b"]) == (["x", "", ""], "ab")
    assert run(StopStringMatcher(["b", "ab"]), ["xb"]) == (["x", ""], "b")
    assert run(StopStringMatcher(["ab", "b"]), ["xab"]) == (["x", ""], "ab")


def test_stop_that_is_a_prefix_of_another() -> None:
    # Both start at the same place; the shorter completes first and wins.
    assert run(StopStringMatcher(["abc", "ab"]), ["a", "b", "c"]) == (["", "", ""], "ab")
    assert run(StopStringMatcher(["abc", "ab"], include_stop_str_in_output=True), ["xab"]) == (["xab", ""], "ab")


def test_complete_match_waits_for_an_earlier_starting_candidate() -> None:
    matcher = StopStringMatcher(["bc", "abcd"])
    assert matcher.feed("xabc") == ("x", None)
    assert matcher.feed("d") == ("", "abcd")

    matcher = StopStringMatcher(["bc", "abcd"])
    assert matcher.feed("xabc") == ("x", None)
    assert matcher.feed("e") == ("a", "bc")


def test_flush_resolves_a_match_that_waited_on_a_longer_stop() -> None:
    matcher = StopStringMatcher(["b", "abaa"])
    assert matcher.feed("xab") == ("x", None)
    assert matcher.flush() == "a"
    assert matcher.matched == "b"
    assert matcher.flush() == ""


def test_stop_at_the_very_start() -> None:
    assert run(StopStringMatcher(["###"]), ["###", "rest"]) == (["", ""], "###")
    assert run(StopStringMatcher(["###"], include_stop_str_in_output=True), ["#", "##x"]) == (["", "###", ""], "###")


def test_unicode_stops() -> None:
    assert run(StopStringMatcher(["。", "🛑"]), ["你好", "🛑", "世界"]) == (["你好", "", ""], "🛑")
    pieces, matched = run(StopStringMatcher(["结束了"]), ["答案是42", "结", "束", "了吗"])
    assert (pieces, matched) == (["答案是42", "", "", "", ""], "结束了")
    assert run(StopStringMatcher(["é"]), ["cafe\u0301", "é!"]) == (["cafe\u0301", "", ""], "é")


def test_include_stop_str_in_output() -> None:
    pieces, matched = run(StopStringMatcher(["</answer>"], include_stop_str_in_output=True), ["42</ans", "wer>tail"])
    assert "".join(pieces) == "42</answer>"
    assert matched == "</answer>"


def test_empty_stop_list_passes_text_straight_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("any <|im_end|> text") == ("any <|im_end|> text", None)
    assert matcher.flush() == ""


def test_feed_after_match_or_flush_raises() -> None:
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("ax") == ("a", "x")
    with pytest.raises(RuntimeError, match="'x'"):
        matcher.feed("more")
    matcher = StopStringMatcher(["x"])
    matcher.flush()
    with pytest.raises(RuntimeError, match="flush"):
        matcher.feed("more")


@pytest.mark.parametrize("stop", [[""], ["ok", ""], [None]])
def test_empty_or_non_string_stop_is_rejected(stop: list) -> None:
    with pytest.raises(ValueError, match=r"stop\[\d\]"):
        StopStringMatcher(stop)


@st.composite
def stops_and_text(draw: st.DrawFn) -> tuple[list[str], str]:
    """Stop strings over a small alphabet, and a text made of stops, pieces of stops and noise, so that
    overlapping and nested matches are common."""
    stops = draw(st.lists(st.text("abc", min_size=1, max_size=4), max_size=3))
    fragment = st.text("abc", max_size=3)
    if stops:
        whole = st.sampled_from(stops)
        piece = st.tuples(whole, st.integers(0, 3), st.integers(1, 4)).map(lambda t: t[0][t[1] : t[1] + t[2]])
        fragment = st.one_of(fragment, whole, piece)
    text = "".join(draw(st.lists(fragment, max_size=6)))
    return stops, text


@settings(max_examples=400, deadline=None)
@given(
    stops_text=stops_and_text(),
    cuts=st.lists(st.integers(0, 24), max_size=10),
    include_stop_str_in_output=st.booleans(),
)
def test_emitted_text_ends_before_the_earliest_stop(
    stops_text: tuple[list[str], str], cuts: list[int], include_stop_str_in_output: bool
) -> None:
    stops, text = stops_text
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    pieces, matched = run(StopStringMatcher(stops, include_stop_str_in_output), deltas)

    found = sorted((text.find(s), len(s), s) for s in stops if s in text)
    if not found:
        assert (matched, "".join(pieces)) == (None, text)
        return
    start, length, stop = found[0]
    end = start + length if include_stop_str_in_output else start
    assert (matched, "".join(pieces)) == (stop, text[:end])
