"""Token ids -> streamed text, one request at a time, without torch.

Byte-level BPE tokens are byte strings, so one token may end halfway through a UTF-8 character (an emoji
is often three or four tokens). `tokenizers` decodes the partial character as U+FFFD; streaming that to a
client would show a replacement character that the next token then "changes". So the detokenizer holds
text back while the decoded window ends in U+FFFD, and only `flush()` emits it as decoded.

Decoding the whole output on every step would cost O(length) per token. Instead we keep two offsets into
`ids` (a few prompt tokens of context, then the output ids):

    ids:  ... context ... | output ...
          [prefix_offset .. read_offset)   already emitted; decoded again only as context
          [read_offset .. end)             not emitted yet

    new text = decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]

and, once that text is complete, slide prefix_offset to read_offset and read_offset to the end. The
context keeps decoders that strip a leading space from the first token (SentencePiece's "▁") from eating
the space of each new token. The window grows only while text is held: for a few tokens while a character
is split, for as long as new ids decode to nothing (skipped special tokens), and without bound only for a
run of tokens that never forms valid UTF-8.

Invariant (byte-level BPE): decode(ids[prefix_offset:read_offset]) never ends in a partial character, so
decode(ids[prefix_offset:]) starts with it and the concatenation of everything emitted equals
decode(output ids).
"""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.engine.text.tokenizer import Tokenizer

# Prompt tokens decoded as context before the first output token (vLLM uses the same number).
NUM_PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's output ids, fed in any batching, into text that never splits a character.

    Lifecycle: `add_tokens` any number of times, then `flush` once when the request ends; `add_tokens`
    after `flush` raises RuntimeError, a second `flush` returns "".
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._pieces: list[str] = []
        context = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character; output bytes would complete it and shift the text.
            # Decoding the output on its own keeps the emitted text equal to decode(output ids).
            context, context_text = [], ""
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = context_text
        self._flushed = False

    @property
    def text(self) -> str:
        """Everything emitted so far (by `add_tokens` and `flush`)."""
        return "".join(self._pieces)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Appends output ids; returns the text they complete (may be "", held back until later ids)."""
        if self._flushed:
            raise RuntimeError("add_tokens() after flush(): the request has ended")
        if not token_ids:
            return ""
        self.token_ids.extend(token_ids)
        self._ids.extend(token_ids)
        text = self._decode(self._ids[self._prefix_offset :])
        # Shorter or equal: the new ids decode to nothing yet (skipped special tokens). Keep them in the
        # window rather than sliding, so a following token still decodes with its context.
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        new_text = text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset :])
        self._pieces.append(new_text)
        return new_text

    def flush(self) -> str:
        """Returns the held-back text as decoded (a character still incomplete stays U+FFFD)."""
        if self._flushed:
            return ""
        self._flushed = True
        text = self._decode(self._ids[self._prefix_offset :])
        new_text = text[len(self._prefix_text) :]
        self._pieces.append(new_text)
        return new_text

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
