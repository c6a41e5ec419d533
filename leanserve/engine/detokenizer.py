"""Incremental detokenization of one request's output, with stop strings.

Text is decoded with the prefix/read offsets of TGI's ``decode_token`` and vLLM's
``detokenize_incrementally``: each step decodes only the tokens since the last-but-one release
(``ids[prefix_offset:]``) and releases what that adds to the decode of ``ids[prefix_offset:read_offset]``.
Decoding a short window from a token boundary keeps the cost per step O(new tokens), and comparing two
decodes that start at the same token keeps spaces right for tokenizers that strip a leading space.
While the window ends with U+FFFD (a UTF-8 character split across byte-level BPE tokens) nothing is
released.

Stop strings (vLLM semantics): the released text is the decoded text minus its longest suffix that
is a proper prefix of some stop string (it may still become one); once a stop string occurs, the text
is cut before it (after it with ``include_stop_str_in_output``) and nothing further is released.
Among several, the one that is complete first in the text wins (ties: the one starting first), which
does not depend on how the text was split into tokens. As vLLM, stop strings are only looked for once
more than ``min_tokens`` tokens were generated; text before that is released unchecked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from leanserve.sampling_params import SamplingParams


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's generated ids into released text deltas.

    Invariant: ``output_text`` is always a prefix of
    ``tokenizer.decode(all ids so far, skip_special_tokens=params.skip_special_tokens)`` (cut at the
    stop string once one matched), and never ends inside a split UTF-8 character mid-stream.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens) -> str`` (leanserve's ``Tokenizer``).
        params: the request's parameters (``stop``, ``include_stop_str_in_output``,
            ``skip_special_tokens``, ``min_tokens``).

    Attributes:
        output_text: all text released so far.
        stop_reason: the stop string that matched, else None.
        finished: True once a stop string matched; later tokens are ignored.
    """

    def __init__(self, tokenizer: _Decoder, params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window (a token boundary)
        self._read_offset = 0  # tokens whose text is in self._text
        self._text = ""  # decoded text of ids[:read_offset] (complete characters)
        self.output_text = ""
        self.stop_reason: str | None = None
        self.finished = False

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Append generated tokens and return the text they release (possibly "").

        Returns "" once ``finished``. The returned deltas concatenate to ``output_text``.
        """
        if self.finished:
            return ""
        self._ids.extend(new_token_ids)
        self._decode(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        """Release all held-back text: the request ended for another reason (length, EOS, abort).

        Returns what ``tokenizer.decode`` gives for the tail, still cut at a stop string should one occur in it;
        an incomplete UTF-8 character at the very end (generation stopped inside it) is dropped, never shown as
        U+FFFD.
        """
        if self.finished:
            return ""
        self._decode(final=True)
        return self._release(final=True)

    def _decode(self, final: bool) -> None:
        """Move the complete text of the new tokens into ``self._text``."""
        if self._read_offset == len(self._ids):
            return
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip_special)
        new_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip_special)
        if final:
            new_text = new_text.rstrip("\ufffd")  # bytes of a character the generation never finished
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self._text += new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)

    def _release(self, final: bool) -> str:
        """Check for stop strings in the unreleased text and release what is safe."""
        start = len(self.output_text)
        end = len(self._text)
        if self._stops and len(self._ids) > self._min_tokens:
            match = self._find_stop(start)
            if match is not None:
                stop, pos = match
                end = pos + len(stop) if self._include_stop else pos
                self.stop_reason, self.finished = stop, True
            elif not final:
                end -= self._partial_stop_len(start)
        delta = self._text[start:end]
        self.output_text += delta
        return delta

    def _find_stop(self, start: int) -> tuple[str, int] | None:
        """(stop string, index in ``self._text``) of the earliest-ending match at or after ``start``.

        No match can begin before ``start``: a text that could still grow into a stop string is held.
        """
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            pos = self._text.find(stop, start)
            if pos >= 0 and (best is None or (pos + len(stop), pos) < best[:2]):
                best = (pos + len(stop), pos, stop)
        return None if best is None else (best[2], best[1])

    def _partial_stop_len(self, start: int) -> int:
        """Length of the longest suffix of ``self._text[start:]`` that is a proper prefix of a stop."""
        pending = self._text[start:]
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(pending)), longest, -1):
                if pending.endswith(stop[:n]):
                    longest = n
                    break
        return longest
