"""Prompt-lookup ("n-gram") drafts (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``prompt_lookup_min/max``).

The longest suffix n-gram of a request's tokens (prompt + output, ``prompt_lookup_max`` down to
``prompt_lookup_min`` tokens) that occurred earlier in them proposes the tokens that followed its most recent
earlier occurrence. Each request keeps an index from n-gram to the position after its latest occurrence, extended
by the new tokens only, so a proposal costs O(prompt_lookup_max) dictionary operations per new token, never a scan
of the context.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """The n-gram index of one request's tokens, which only grow at the end.

    Args:
        min_n, max_n: n-gram lengths indexed, in tokens (1 <= min_n <= max_n).
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []  # the request's tokens seen so far (prompt, then output)
        self._maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._indexed = 0  # n-grams ending before this position are in the maps

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append tokens to the indexed sequence."""
        self.tokens.extend(new_tokens)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` draft tokens following the most recent earlier occurrence of the longest suffix n-gram."""
        tokens = self.tokens
        end = len(tokens) - 1  # n-grams ending at the last token are the suffixes looked up, not yet indexed
        for i in range(self._indexed, end):
            for n, table in self._maps.items():
                if i + 1 >= n:
                    table[tuple(tokens[i + 1 - n:i + 1])] = i + 1  # the latest occurrence wins
        self._indexed = max(self._indexed, end)
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = self._maps[n].get(tuple(tokens[len(tokens) - n:]))
            if start is not None:
                return tokens[start:start + k]
        return []


class NgramProposer:
    """Drafts for every request, each from its own :class:`NgramIndex` (dropped with :meth:`reset`)."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
                k: int) -> list[int]:
        """Up to ``k`` drafts for a request whose tokens so far are prompt + output; only the tokens the index
        has not seen are read."""
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = NgramIndex(self.min_n, self.max_n)
            index.extend(prompt_token_ids)
        seen = len(index.tokens) - len(prompt_token_ids)
        if seen < len(output_token_ids):
            index.extend(output_token_ids[seen:])
        return index.propose(k)

    def reset(self, request_id: str) -> None:
        """Forget a request (it ended)."""
        self._indexes.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._indexes)
