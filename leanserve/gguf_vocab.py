"""Building a ``tokenizers.Tokenizer`` from a GGUF file's ``tokenizer.*`` metadata (llama.cpp key names).

Used by :meth:`leanserve.tokenizer.Tokenizer.from_gguf`; returns the keyword arguments of ``Tokenizer``. Also
holds the vocabulary tables every tokenizer uses (GPT-2's byte alphabet, the end-of-turn token texts). It sits
below :mod:`leanserve.tokenizer` and imports nothing from it (the loader imports both, never the reverse).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from leanserve.errors import ModelLoadError

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

logger = logging.getLogger(__name__)

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # tokenizer.ggml.token_type values

# Pre-tokenizer regexes, as llama.cpp (llama-vocab.cpp) and the models' own tokenizer.json use them.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# name -> (split regex or None for GPT-2's own regex, split digits one by one first, ignore_merges)
_PRE_TOKENIZERS: dict[str, tuple[str | None, bool, bool]] = {
    **dict.fromkeys(("gpt2", "mpt", "olmo"), (None, False, False)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), (None, True, False)
    ),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3"), (_LLAMA3, False, True)),
    **dict.fromkeys(("dbrx", "smaug-bpe"), (_LLAMA3, False, False)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), (_QWEN2, False, False)),
}


# Texts of end-of-turn tokens: any the vocabulary has as a control token also stops generation.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "</s>",
    "<|eom_id|>",
)


def _gpt2_chars() -> list[str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet), indexed by byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


BYTE_TO_CHAR: dict[int, str] = dict(enumerate(_gpt2_chars()))
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_CHAR.items()}


def _byte_level(tokens: list[str], types: list[int], meta: Callable[[str, Any], Any]) -> Backend:
    pre = meta("tokenizer.ggml.pre", None)
    if pre is None:
        logger.warning("GGUF file names no tokenizer.ggml.pre; using GPT-2's pre-tokenizer")
        pre = "gpt2"
    if pre not in _PRE_TOKENIZERS:
        raise ModelLoadError(
            f"unsupported GGUF pre-tokenizer {pre!r} (supported: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    regex, split_digits, ignore_merges = _PRE_TOKENIZERS[pre]
    alphabet = set(CHAR_TO_BYTE)
    vocab: dict[str, int] = {}
    for i, (tok, kind) in enumerate(zip(tokens, types, strict=True)):
        # Added tokens keep their text; a normal token spelled outside the byte alphabet is re-spelled in it.
        if kind not in (CONTROL, USER_DEFINED) and not set(tok) <= alphabet:
            tok = "".join(BYTE_TO_CHAR[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)
    merges = [tuple(m.split(" ", 1)) for m in meta("tokenizer.ggml.merges", None) or []]
    backend = Backend(BPE(vocab, merges, ignore_merges=ignore_merges))
    if regex is None:
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    else:
        steps = [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    if split_digits:
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two vocabulary pieces,
    best (highest-scoring merged token) first -- the order HF's slow->fast converters use."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges: list[tuple[str, str, float]] = []
    for tok, score in zip(tokens, scores, strict=True):
        local = [
            (tok[:k], tok[k:], score) for k in range(1, len(tok)) if tok[:k] in vocab and tok[k:] in vocab
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _sentencepiece(tokens: list[str], types: list[int], meta: Callable[[str, Any], Any]) -> Backend:
    scores = meta("tokenizer.ggml.scores", None)
    if scores is None:
        raise ModelLoadError("GGUF llama tokenizer has no tokenizer.ggml.scores")
    unk_id = meta("tokenizer.ggml.unknown_token_id", None)
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    backend = Backend(
        BPE(
            vocab,
            _sentencepiece_merges(tokens, [float(s) for s in scores]),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(meta("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def gguf_tokenizer_kwargs(meta: Callable[[str, Any], Any]) -> dict[str, Any]:
    """Keyword arguments of :class:`leanserve.tokenizer.Tokenizer` for a GGUF vocabulary.

    ``meta(key, default)`` returns a metadata value. ``tokenizer.ggml.model`` ``gpt2`` gives byte-level BPE
    with the pre-tokenizer named by ``tokenizer.ggml.pre``; ``llama`` gives SentencePiece-style BPE built from
    the token scores, with byte fallback. CONTROL tokens become special added tokens, USER_DEFINED ones
    non-special added tokens (both always matched whole in the text).

    Raises:
        ModelLoadError: no/unknown tokenizer model, unknown pre-tokenizer, or inconsistent ids.
    """
    model = meta("tokenizer.ggml.model", None)
    tokens = meta("tokenizer.ggml.tokens", None)
    if model is None or not tokens:
        raise ModelLoadError("GGUF file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens)")
    tokens = list(tokens)
    types = list(meta("tokenizer.ggml.token_type", None) or [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ModelLoadError("tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length")
    if model == "gpt2":
        backend, kind = _byte_level(tokens, types, meta), "byte_level"
    elif model == "llama":
        backend, kind = _sentencepiece(tokens, types, meta), "sentencepiece"
    else:
        raise ModelLoadError(f"unsupported GGUF tokenizer model {model!r} (supported: gpt2, llama)")

    def token_id(key: str) -> int | None:
        value = meta(f"tokenizer.ggml.{key}", None)
        if value is None:
            return None
        if not 0 <= int(value) < len(tokens):
            raise ModelLoadError(f"tokenizer.ggml.{key} = {value} is outside the vocabulary")
        return int(value)

    bos, eos, unk, pad = (
        token_id(k) for k in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")
    )
    if eos is None:
        raise ModelLoadError("GGUF file has no tokenizer.ggml.eos_token_id")
    special_ids = {i for i, t in enumerate(types) if t == CONTROL}
    if unk is not None and types[unk] == UNKNOWN:
        special_ids.add(unk)
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special_ids)]
    )
    backend.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types)
            if t == USER_DEFINED
        ]
    )
    added_ids = special_ids | {i for i, t in enumerate(types) if t == USER_DEFINED}
    for i in sorted(added_ids):
        if backend.token_to_id(tokens[i]) != i:
            raise ModelLoadError(
                f"GGUF vocabulary lists token {tokens[i]!r} twice (ids {backend.token_to_id(tokens[i])}, {i})"
            )
    stop = {eos}
    for key in ("eot_token_id", "eom_token_id"):
        if (tid := token_id(key)) is not None:
            stop.add(tid)
    stop |= {i for i in special_ids if tokens[i] in END_OF_TURN_TOKENS}
    return {
        "backend": backend,
        "kind": kind,
        "vocab_size": len(tokens),
        "bos_token_id": bos,
        "eos_token_id": eos,
        "stop_token_ids": frozenset(stop),
        "add_bos": bool(meta("tokenizer.ggml.add_bos_token", model == "llama")),
        "chat_template": meta("tokenizer.chat_template", None),
        "special_ids": frozenset(special_ids),
        "special_tokens": {
            name: tokens[i]
            for name, i in (("bos_token", bos), ("eos_token", eos), ("unk_token", unk), ("pad_token", pad))
            if i is not None
        },
    }
