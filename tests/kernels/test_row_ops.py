"""The native per-row ops of the decode step (leanserve/kernels/row_ops.cpp): ``argmax_rows`` equals torch's
``argmax(-1)`` (first of ties, first NaN, +0 == -0, infinities) at every width, and the Sampler's greedy rows
pick the same tokens through it as through its torch path."""

from __future__ import annotations

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve.kernels import native_ops
from leanserve.sampling_params import SamplingParams
from leanserve.worker.sampler import Sampler, SamplingState

import pytest
import torch

pytestmark = pytest.mark.skipif(native_ops() is None, reason="the native kernels did not build")


@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 1000, 1024, 49152, 49153])
def test_argmax_rows_equals_torch(m: int) -> None:
    g = torch.Generator().manual_seed(m)
    x = torch.randn(5, m, generator=g)
    x[1] = x[1].round()  # many ties: the first one wins
    x[2] = 0.0
    x[3, :: 3] = float("-inf")
    assert torch.equal(native_ops().argmax_rows(x), x.argmax(-1))


@pytest.mark.parametrize("m", [1, 8, 13, 64, 49152])
def test_argmax_rows_special_values(m: int) -> None:
    x = torch.full((6, m), -1.0)
    x[0, m // 2:] = float("inf")  # the first +inf
    x[1, m - 1] = float("nan")  # a NaN counts as the maximum
    x[2, m // 3] = float("nan")
    x[2, m - 1] = float("nan")  # the first NaN
    x[3] = float("-inf")  # all -inf: index 0
    x[4, m // 2:] = 0.0
    x[4, m // 2] = -0.0  # -0 == +0: the first zero
    x[5, m // 4] = 3.0
    x[5, m - 1] = float("inf")
    expect = x.argmax(-1)
    assert torch.equal(native_ops().argmax_rows(x), expect)
    assert expect[1] == m - 1 and expect[2] == m // 3  # what torch defines, checked once here


def test_argmax_rows_non_contiguous_and_bad_input() -> None:
    x = torch.randn(64, 300)
    view = x[::2, 5:290]
    assert torch.equal(native_ops().argmax_rows(view), view.argmax(-1))
    assert native_ops().argmax_rows(torch.empty(0, 10)).shape == (0,)
    for bad in (torch.randn(4, 10).double(), torch.randn(10), torch.empty(3, 0)):
        with pytest.raises(RuntimeError, match="float32"):
            native_ops().argmax_rows(bad)


def test_sampler_greedy_rows_through_the_kernel() -> None:
    """Greedy rows (alone, and beside sampled rows and logprobs rows) get torch's argmax through the kernel."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 49152, generator=g)
    logits[0, 100:] = logits[0, 100:].round()  # ties
    native, plain = Sampler(frozenset({2}), argmax_kernel=native_ops().argmax_rows), Sampler(frozenset({2}))

    def states(params: list[SamplingParams]) -> list[SamplingState]:
        return [SamplingState(p, [1, 2, 3], [4], torch.Generator().manual_seed(i) if not p.is_greedy else None)
                for i, p in enumerate(params)]

    greedy = [SamplingParams(temperature=0.0, max_tokens=4)] * 6
    out = native(logits, states(greedy))
    assert out.token_ids == logits.argmax(-1).tolist() == plain(logits, states(greedy)).token_ids
    assert out.logprobs == [None] * 6
    mixed = [SamplingParams(temperature=0.0, max_tokens=4, logprobs=2 if i == 1 else None) if i % 2 == 0 or i == 1
             else SamplingParams(temperature=0.8, seed=i, max_tokens=4) for i in range(6)]
    a, b = native(logits, states(mixed)), plain(logits, states(mixed))
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert [a.token_ids[i] for i in (0, 1, 2, 4)] == logits.argmax(-1)[[0, 1, 2, 4]].tolist()
    assert a.logprobs[1] is not None and a.logprobs[1].rank == 1
