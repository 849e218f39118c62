"""A byte-level BPE tokenizer trained offline, at make-model time, for random-weight checkpoints.

The corpus is the docstrings of a fixed, sorted list of standard-library modules (read from their source
files) plus a short built-in text, so training needs no network and gives a byte-identical tokenizer.json
for a given Python version. The pipeline is Qwen2's: NFC, Qwen2's split regex, byte-level BPE.

Id layout for a model with vocab_size V and the default first_special_id (V - 3):

    [0, 256)                 the byte-level alphabet (what the trainer starts from)
    [256, L)                 learned merges, L <= MAX_LEARNED_TOKENS, limited by the corpus
    [L, first_special_id)    filler pseudo-words ("Ġkavo"): ordinary vocab entries no merge reaches
    first_special_id + k     special_tokens[k], added tokens with special=True (Qwen: the highest ids)
    after the specials       more fillers, only when first_special_id < V - len(special_tokens)

Every id in [0, V) exists and decodes to non-empty text, because random weights emit any id. The special
tokens also sit in the BPE vocab at their ids: an added token that is already in the model vocab keeps
that id when tokenizer.json is loaded, which is what lets specials sit below fillers (qwen2.5-0.5b).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

DEFAULT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MAX_LEARNED_TOKENS = 4096  # alphabet included; the corpus itself tops out near 8k at min_frequency 2

# Qwen2's pre-tokenizer split: contractions, letter runs, single digits, punctuation runs, whitespace.
QWEN2_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen2's ChatML template: a default system message unless the conversation brings its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Pure-Python modules present on every CPython build and platform; their docstrings are the corpus. Read
# from source in a fixed order, so the text (hence the merges) is fixed for a given Python version.
CORPUS_MODULES = (
    "argparse",
    "ast",
    "base64",
    "calendar",
    "collections",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "difflib",
    "email.message",
    "enum",
    "fractions",
    "functools",
    "getopt",
    "gzip",
    "heapq",
    "http.client",
    "inspect",
    "ipaddress",
    "json",
    "logging",
    "mailbox",
    "optparse",
    "pathlib",
    "queue",
    "random",
    "re",
    "sched",
    "smtplib",
    "statistics",
    "string",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "typing",
    "urllib.parse",
    "uuid",
    "zipfile",
)

BUILTIN_TEXT = """\
The quick brown fox jumps over the lazy dog. Hello! How are you today? I am fine, thank you.
You are a helpful assistant. What is the capital of France? The capital of France is Paris.
Please write a short story about a robot who learns to paint. Once upon a time, there was a robot.
A server receives a request, runs the prompt through the model, and streams tokens back to the user.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159. Code: def main(): print("hello, world")
"""

_SYLLABLES = tuple(c + v for c in "bdfghklmnprstvz" for v in "aeiou")
_BYTE_LEVEL_SPACE = "\u0120"  # "Ġ": how the byte-level alphabet writes " "


def train_tokenizer(
    vocab_size: int,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
    first_special_id: int | None = None,
) -> Tokenizer:
    """Trains the corpus BPE and pads it to exactly vocab_size ids (layout in the module docstring)."""
    num_special = len(special_tokens)
    if first_special_id is None:
        first_special_id = vocab_size - num_special
    alphabet_size = len(pre_tokenizers.ByteLevel.alphabet())
    if not alphabet_size <= first_special_id <= vocab_size - num_special:
        raise ValueError(
            f"vocab_size={vocab_size} with first_special_id={first_special_id} leaves no room for the "
            f"{alphabet_size}-symbol byte alphabet below {num_special} special tokens"
        )
    learned = _train_corpus_bpe(min(first_special_id, MAX_LEARNED_TOKENS))
    vocab: dict[str, int] = learned.get_vocab()
    merges = _merges_of(learned)
    assert sorted(vocab.values()) == list(range(len(vocab))), "trainer ids must be dense"

    fillers = _filler_words(exclude=set(vocab) | set(special_tokens))
    for token_id in range(len(vocab), vocab_size):
        if first_special_id <= token_id < first_special_id + num_special:
            vocab[special_tokens[token_id - first_special_id]] = token_id
        else:
            vocab[next(fillers)] = token_id

    # "" rather than None, as in Qwen2's tokenizer.json: transformers' Qwen2Tokenizer rebuilds it that way.
    bpe = models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="")
    tokenizer = Tokenizer(bpe)
    _set_pipeline(tokenizer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    assert tokenizer.get_vocab_size() == vocab_size
    assert [tokenizer.token_to_id(t) for t in special_tokens] == list(
        range(first_special_id, first_special_id + num_special)
    )
    return tokenizer


@functools.cache  # pure (the source files of this Python), and parsing them takes ~0.5 s
def corpus_texts() -> tuple[str, ...]:
    """The training texts, in training order: one per docstring, then BUILTIN_TEXT."""
    texts = [doc for module_name in CORPUS_MODULES for doc in _module_docstrings(module_name)]
    return (*texts, BUILTIN_TEXT)


def tokenizer_config(tokenizer: Tokenizer, model_max_length: int) -> dict:
    """tokenizer_config.json for a tokenizer from train_tokenizer (Qwen2.5-Instruct's keys)."""
    added = tokenizer.get_added_tokens_decoder()
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): {
                "content": token.content,
                "lstrip": token.lstrip,
                "normalized": token.normalized,
                "rstrip": token.rstrip,
                "single_word": token.single_word,
                "special": token.special,
            }
            for token_id, token in sorted(added.items())
        },
        "additional_special_tokens": [
            added[i].content for i in sorted(added) if added[i].special and added[i].content != "<|endoftext|>"
        ],
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        # Loads tokenizer.json as it is, in transformers 4.x and 5. (For model_type qwen2, transformers 5 picks
        # Qwen2Tokenizer whatever this says; it rebuilds Qwen2's pipeline around our vocab and merges, which
        # is why ours is exactly that pipeline: tests check both encode alike.)
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def _train_corpus_bpe(max_tokens: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    _set_pipeline(tokenizer)
    trainer = trainers.BpeTrainer(
        vocab_size=max_tokens,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Merge ties are broken by pair ids, so training is deterministic even when rayon runs in parallel.
    tokenizer.train_from_iterator(corpus_texts(), trainer=trainer)
    return tokenizer


def _set_pipeline(tokenizer: Tokenizer) -> None:
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)


def _merges_of(tokenizer: Tokenizer) -> list[tuple[str, str]]:
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in merges]


def _module_docstrings(module_name: str) -> list[str]:
    """Docstrings of the module and of its classes and functions (ast.walk order: deterministic).

    Read from the source with ast rather than imported: a live module's members depend on what else the
    process imported (transformers, for one, adds methods to logging.Logger), and the corpus must not.
    """
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise RuntimeError(f"no source for standard-library module {module_name!r} to train the tokenizer on")
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    definitions = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = [tree, *(node for node in ast.walk(tree) if isinstance(node, definitions))]
    return [doc for doc in (ast.get_docstring(node) for node in nodes) if doc]


def _filler_words(exclude: set[str]) -> Iterator[str]:
    """Distinct space-led pseudo-words ("Ġkavo", "Ġbadefi", ...): readable when a random model emits them."""
    for num_syllables in itertools.count(2):
        for syllables in itertools.product(_SYLLABLES, repeat=num_syllables):
            word = _BYTE_LEVEL_SPACE + "".join(syllables)
            if word not in exclude:
                yield word
