"""Stop strings over streamed text, without torch.

A stop string may arrive split across any number of deltas ("<|e", "nd", "|>"), and none of its characters
may reach the client. So the matcher holds back the tail of the text that could still grow into a stop
string, and emits only what can no longer be part of one.

Which stop wins is defined on the whole text, not on how it was chopped into deltas: the match that starts
earliest, and among matches starting at the same place the shortest (the one that completes first). A
complete match is therefore not final while an earlier-starting stop could still complete: with stops
"bc" and "abcd", the text "abc" waits for the next character.

    emitted + flush()  ==  text[:start of the winning match]   (or the whole text when nothing matches)
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Finds the first stop string in a request's streamed text.

    Lifecycle: `feed` deltas until it returns a matched stop string or the request ends for another reason;
    then `flush` (which returns "" after a match). `feed` after a match or after `flush` raises RuntimeError.
    `matched` is the stop string that ended the text, or None; `flush` itself may set it (see there).
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}] must be a non-empty string, got {s!r}")
        self.stop: tuple[str, ...] = tuple(dict.fromkeys(stop))
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        # Invariant: `_held` is a proper prefix of some stop string, so shorter than the longest one. It
        # may contain a complete match that waits on an earlier-starting candidate.
        self._held = ""
        self.matched: str | None = None
        self._flushed = False

    def feed(self, text: str) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the matched stop string or None).

        On a match the emitted text ends right before the stop string (right after it with
        include_stop_str_in_output) and everything fed after it is dropped.
        """
        if self.matched is not None:
            raise RuntimeError(f"feed() after stop string {self.matched!r} matched")
        if self._flushed:
            raise RuntimeError("feed() after flush(): the request has ended")
        if not self.stop:
            return text, None
        buffer = self._held + text
        match = self._earliest_match(buffer)
        # A candidate that starts before the match (or anywhere, without one) must be held back.
        end = match[0] if match is not None else len(buffer)
        candidate = self._earliest_candidate(buffer, end)
        if candidate is not None:
            self._held = buffer[candidate:]
            return buffer[:candidate], None
        self._held = ""
        if match is None:
            return buffer, None
        return self._cut(buffer, *match), self.matched

    def flush(self) -> str:
        """Returns the held-back text; "" after a match (the text after a stop string is dropped).

        The held text may hold a complete match that was waiting on an earlier-starting candidate; that
        candidate can no longer complete, so the match stands: the text is cut there and `matched` set.
        """
        held, self._held = self._held, ""
        if self.matched is not None or self._flushed:
            return ""
        self._flushed = True
        match = self._earliest_match(held)
        return held if match is None else self._cut(held, *match)

    def _cut(self, buffer: str, start: int, stop: str) -> str:
        """Records the match of `stop` at `start`; returns the text of `buffer` that may be emitted."""
        self.matched = stop
        return buffer[: start + len(stop)] if self.include_stop_str_in_output else buffer[:start]

    def _earliest_match(self, buffer: str) -> tuple[int, str] | None:
        """(start, stop) of the earliest-starting complete stop in `buffer`, shortest first on ties."""
        best: tuple[int, int, str] | None = None
        for stop in self.stop:
            start = buffer.find(stop)
            if start >= 0 and (best is None or (start, len(stop)) < best[:2]):
                best = (start, len(stop), stop)
        return None if best is None else (best[0], best[2])

    def _earliest_candidate(self, buffer: str, end: int) -> int | None:
        """The smallest start < `end` whose suffix of `buffer` is a proper prefix of some stop string."""
        for start in range(max(0, len(buffer) - self._max_stop_len + 1), end):
            tail = buffer[start:]
            if any(len(tail) < len(stop) and stop.startswith(tail) for stop in self.stop):
                return start
        return None
