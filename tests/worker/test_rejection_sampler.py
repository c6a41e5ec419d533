"""Speculative sampling keeps the target distribution p whatever the draft distribution q (Leviathan et al. 2023)."""

from __future__ import annotations

from leanserve.worker.rejection_sampler import accept_one_hot, rejection_sample

import pytest
import torch

P = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]])  # target at the draft position and the bonus one
Q = torch.tensor([[0.1, 0.1, 0.4, 0.4]])  # a poor draft distribution


def first_token_frequencies(num: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(4)
    for _ in range(num):
        draft = int(torch.multinomial(Q[0], 1, generator=g))
        counts[rejection_sample(P, Q, [draft], g)[0]] += 1
    return counts / num


def test_first_token_converges_to_p_not_to_q():
    small, large = first_token_frequencies(500), first_token_frequencies(20_000)
    err_small, err_large = (small - P[0]).abs().max(), (large - P[0]).abs().max()
    assert err_large < 0.015 and err_large < err_small
    assert (large - Q[0]).abs().max() > 0.3  # nowhere near the draft's distribution


def test_output_is_accepted_drafts_then_one_token():
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert rejection_sample(p, q, [1, 2], g) == [1, 2, 0]  # both accepted, then the bonus token
    q_bad = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    assert rejection_sample(p, q_bad, [0, 2], g) == [1]  # p(0) = 0: rejected, corrected from max(0, p - q)
    with pytest.raises(ValueError):
        rejection_sample(p, q, [1], g)


def test_one_hot_acceptance_is_the_common_prefix():
    assert accept_one_hot([5, 6, 7], [5, 6]) == 2
    assert accept_one_hot([5, 9, 7], [5, 6]) == 1
    assert accept_one_hot([4, 6, 7], [5, 6]) == 0
