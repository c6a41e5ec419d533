"""Prompt-lookup drafts: the longest suffix n-gram's latest earlier occurrence proposes what followed it."""

from __future__ import annotations

from leanserve.spec_decode.ngram import NgramIndex, NgramProposer


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, by scanning: longest n first, most recent earlier occurrence."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # occurrences ending before the last token
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_longest_match_wins_and_its_continuation_is_proposed():
    ix = NgramIndex(1, 3)
    ix.extend([1, 2, 3, 4, 5, 9, 2, 3])
    assert ix.propose(3) == [4, 5, 9]  # "2 3" occurred at 1-2; "9 2 3" never did
    ix.extend([7])
    assert ix.propose(3) == []  # 7 never occurred before
    ix.extend([1, 2])
    assert ix.propose(2) == [3, 4]  # "1 2" at 0-1 (the suffix itself is not an earlier occurrence)


def test_most_recent_occurrence_and_short_continuations():
    ix = NgramIndex(1, 2)
    ix.extend([5, 6, 5, 8, 5])
    assert ix.propose(4) == [8, 5]  # "5" last occurred at 2, followed by 8, 5
    ix = NgramIndex(2, 3)
    ix.extend([4, 4, 4])
    assert ix.propose(5) == [4]  # "4 4" at 0-1: only one token follows it


def test_incremental_index_equals_the_definition_on_random_text():
    import random

    rng = random.Random(0)
    tokens: list[int] = []
    ix = NgramIndex(2, 4)
    for step in range(600):
        new = [rng.randrange(6)] if step % 3 else [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
        tokens += new
        ix.extend(new)
        assert ix.propose(5) == brute_force(tokens, 5, 2, 4), step


def test_proposer_reads_only_new_output_and_forgets_requests():
    p = NgramProposer(1, 3)
    prompt = [10, 11, 12, 13]
    assert p.propose("a", prompt, [10, 11], 2) == [12, 13]
    assert p.propose("a", prompt, [10, 11, 12], 3) == [13, 10, 11]
    assert p.propose("b", [1, 2], [], 2) == []
    assert len(p) == 2
    p.reset("a")
    assert len(p) == 1
