"""Sampler: greedy, truncation, penalties, min_tokens, seeding, batch invariance, distribution, logprobs."""

import math

from leanserve.sampling_params import SamplingParams
from leanserve.worker.sampler import (
    Sampler,
    SamplingState,
    _argmax,
    _inverse_cdf,
    _presence_frequency_penalty,
    _repetition_penalty,
    _topk,
    _truncate,
)

import pytest
import torch

EOS = 2


def _state(params, prompt=(), output=(), seed=None, generator=None):
    if generator is None and seed is not None:
        generator = torch.Generator().manual_seed(seed)
    return SamplingState(params, list(prompt), list(output), generator)


def _sample(logits, states, stop_ids=frozenset({EOS})):
    return Sampler(stop_ids)(torch.as_tensor(logits, dtype=torch.float32), states)


def _counts(logits_row, params, draws, vocab, seed=0, output=()):
    """Token counts over ``draws`` samples of one row (batched, one shared generator)."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(vocab, dtype=torch.long)
    batch = 1000
    logits = torch.tensor([logits_row] * batch, dtype=torch.float32)
    for _ in range(draws // batch):
        out = _sample(logits, [_state(params, output=output, generator=gen) for _ in range(batch)])
        counts += torch.bincount(torch.tensor(out.token_ids), minlength=vocab)
    return counts


def test_greedy_is_argmax_and_input_untouched():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    out = Sampler(frozenset({EOS}))(logits, [_state(SamplingParams(temperature=0)) for _ in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5
    assert torch.equal(logits, before)


@pytest.mark.parametrize("vocab", [5, 2048, 49152, 32000, 32001, 151936])
def test_two_level_argmax_matches_argmax(vocab):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=gen)
    x[1, -1] = 100.0  # max in the last block
    x[2, :] = 0.0  # all tied: first index
    x[3, 1] = x[3, vocab - 2] = 50.0  # tie across blocks: the first
    x = x.to(torch.bfloat16).float()  # many ties
    assert torch.equal(_argmax(x), x.argmax(-1))


@pytest.mark.parametrize("vocab", [49152, 32000, 32001])
@pytest.mark.parametrize("k", [1, 5, 20, 64, 512])
def test_blocked_topk_matches_topk(vocab, k):
    x = torch.randn(4, vocab, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16).float()
    x[1, -3:] = 30.0  # the largest values in the last block
    vals, idx = _topk(x, k)
    ref = x.topk(k, dim=-1).values
    assert torch.equal(vals, ref)
    assert torch.equal(x.gather(1, idx), vals)
    assert all(len(set(row)) == k for row in idx.tolist())  # distinct tokens


def test_bfloat16_logits_accepted():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, -1.0, 0.5]], dtype=torch.bfloat16)
    out = Sampler(frozenset())(logits, [_state(SamplingParams(temperature=0, logprobs=1))] * 2)
    assert out.token_ids == [1, 0]
    assert out.logprobs[0].logprob == pytest.approx(torch.log_softmax(logits.float(), -1)[0, 1].item())


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        _sample(torch.zeros(2, 4), [_state(SamplingParams(temperature=0))])


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0, 100.0])
def test_top_k_1_is_argmax(temperature):
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=temperature, top_k=1)
    out = _sample(logits, [_state(params, seed=i) for i in range(64)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_is_argmax():
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=2.0, top_p=1e-6)
    out = _sample(logits, [_state(params, seed=i) for i in range(64)])
    assert out.token_ids == logits.argmax(-1).tolist()


# probabilities 0.5, 0.3, 0.15, 0.05
_LOGITS4 = [math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]


@pytest.mark.parametrize(
    ("kwargs", "allowed"),
    [
        ({"min_p": 0.35}, {0, 1}),  # cut at 0.35 * 0.5 = 0.175
        ({"min_p": 0.2}, {0, 1, 2}),  # cut at 0.1
        ({"min_p": 1.0}, {0}),
        ({"top_k": 2}, {0, 1}),
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_p": 0.7}, {0, 1}),  # 0.5 < 0.7 so token 1 is needed, then 0.8 >= 0.7
        ({"top_p": 0.85}, {0, 1, 2}),
        ({"top_p": 0.45}, {0}),
        ({"top_k": 3, "min_p": 0.5}, {0, 1}),
    ],
)
def test_truncation_keeps_exactly_the_allowed_tokens(kwargs, allowed):
    counts = _counts(_LOGITS4, SamplingParams(**kwargs), 4000, 4)
    assert {i for i in range(4) if counts[i] > 0} == allowed


_LOGITS6 = [1.0, 0.5, -0.3, 2.0, 0.0, -1.0]


@pytest.mark.parametrize(
    ("kwargs", "kept"),
    [
        ({"temperature": 0.7}, [0, 1, 2, 3, 4, 5]),
        ({"temperature": 1.0, "top_k": 3}, [0, 1, 3]),
        ({"temperature": 1.3, "top_p": 0.75}, [0, 1, 3]),
        ({"temperature": 0.5, "min_p": 0.04}, [0, 1, 3]),
    ],
)
def test_empirical_distribution_matches_softmax(kwargs, kept):
    """~20k draws match softmax(logits / T) renormalized over the kept tokens (4.5 sigma per token)."""
    scaled = torch.tensor(_LOGITS6, dtype=torch.float64) / kwargs["temperature"]
    full = torch.softmax(scaled, -1)
    if "top_p" in kwargs:  # the nucleus assumed above: the fewest top tokens with mass >= top_p
        top = full.sort(descending=True).values
        assert top[:2].sum() < kwargs["top_p"] <= top[:3].sum()
    if "min_p" in kwargs:
        assert sorted((full >= kwargs["min_p"] * full.max()).nonzero().flatten().tolist()) == kept
    mask = torch.full((6,), float("-inf"), dtype=torch.float64)
    mask[kept] = 0.0
    expected = torch.softmax(scaled + mask, -1)
    draws = 20_000
    freq = _counts(_LOGITS6, SamplingParams(**kwargs), draws, 6, seed=11).double() / draws
    sigma = (expected * (1 - expected) / draws).sqrt()
    assert torch.all((freq - expected).abs() <= 4.5 * sigma + 1e-9), (freq, expected)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_p": 0.05},
        {"top_p": 0.3},
        {"top_p": 0.6},
        {"top_p": 0.9},
        {"top_p": 0.99},
        {"top_k": 700, "top_p": 0.5},
        {"top_k": 3000},
        {"min_p": 0.2},
        {"top_p": 0.95, "min_p": 0.9},
    ],
)
def test_truncation_cut_matches_full_sort(kwargs):
    """Flat rows need wider candidate sets (64, 512, 4096): the kept set equals a full-sort reference."""
    probs = torch.softmax(torch.randn(3, 5000, generator=torch.Generator().manual_seed(12)) * 0.3, -1)
    params = SamplingParams(**kwargs)
    tokens, cuts = _truncate(probs, [params] * 3, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    for r in range(3):
        ordered = probs[r].double().sort(descending=True).values
        if params.top_k:
            ordered = ordered[: params.top_k] / ordered[: params.top_k].sum()
        before = ordered.cumsum(0) - ordered  # mass of the strictly more likely tokens
        n_keep = int((before < params.top_p).sum())
        n_keep = min(n_keep, int((ordered >= params.min_p * ordered[0]).sum()))
        kept = probs[r] >= cuts[r]
        assert int(kept.sum()) == n_keep
        assert tokens[r] == -1 or kept[tokens[r]]  # sampled inside the kept set, if sampled there


@pytest.mark.parametrize(
    ("kwargs", "mass_a"),
    [
        ({"min_p": 0.04}, 5000 / (5000 + 5000 * math.exp(-3))),  # keeps all 10000: whole-row masking
        ({"min_p": 0.06}, 1.0),  # keeps the 5000 of group A (ties spill past every candidate width)
        ({"top_p": 0.5}, 1.0),  # all of group A are tied with the cut
        ({"top_k": 600, "top_p": 0.9}, 1.0),  # 600 of group A (ties spill past k: all 5000 kept)
    ],
)
def test_wide_kept_sets(kwargs, mass_a):
    """Kept sets wider than the candidates: group A = ids 0..4999 (logit 0), group B = 5000..9999 (-3)."""
    logits = [0.0] * 5000 + [-3.0] * 5000
    gen = torch.Generator().manual_seed(13)
    states = [_state(SamplingParams(**kwargs), generator=gen) for _ in range(250)]
    toks = torch.tensor([t for _ in range(8) for t in _sample([logits] * 250, states).token_ids])
    frac_a = (toks < 5000).double().mean().item()
    assert abs(frac_a - mass_a) <= 4.5 * math.sqrt(mass_a * (1 - mass_a) / len(toks)) + 1e-9
    # uniform over the tied tokens of group A: as many distinct ids as balls in 5000 bins
    distinct_a = len({t for t in toks.tolist() if t < 5000})
    expected = 5000 * (1 - math.exp(-(toks < 5000).sum().item() / 5000))
    assert abs(distinct_a - expected) < 0.05 * expected


def test_top_k_ties_count_in_top_p_mass():
    """top_k=2 keeps every token tied with the 2nd (199 of them), and top_p is a share of all of them."""
    logits = [0.0] + [-5.0] * 199
    p0 = 1 / (1 + 199 * math.exp(-5))  # 0.427 < top_p: the tied tokens are needed too
    counts = _counts(logits, SamplingParams(top_k=2, top_p=0.6), 4000, 200, seed=14)
    assert abs(counts[0].item() / 4000 - p0) < 4.5 * math.sqrt(p0 * (1 - p0) / 4000)


@pytest.mark.parametrize("vocab", [4, 8192])  # one cumsum / two levels of 1024-blocks
def test_inverse_cdf_edges(vocab):
    probs = torch.zeros(3, vocab)
    probs[:, 1], probs[:, vocab // 2] = 0.3, 0.7  # zeros before, between and after
    u = torch.tensor([0.0, 1 - 1e-12, 0.3], dtype=torch.float64)
    assert _inverse_cdf(probs, u).tolist() == [1, vocab // 2, vocab // 2]


def test_repetition_penalty_exact_values():
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    states = [
        _state(SamplingParams(repetition_penalty=2.0), prompt=[0, 4], output=[1, 1]),
        _state(SamplingParams(repetition_penalty=0.5), prompt=[3], output=[]),
    ]
    _repetition_penalty(x, [0, 1], states)
    assert x.tolist() == [[1.0, -2.0, 0.5, 3.0, -4.0], [2.0, -1.0, 0.5, 6.0, -2.0]]


def test_presence_frequency_penalty_exact_values():
    x = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    states = [_state(params, prompt=[2], output=[0, 0, 0, 1]), _state(params, output=[])]
    _presence_frequency_penalty(x, [0, 1], states)
    assert x.tolist() == [[-0.75, 0.25, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]]


@pytest.mark.parametrize(
    ("logits", "penalty", "prompt", "output", "expected"),
    [
        ([3.0, 2.0], 2.0, [0], [], 1),  # 3 / 2 = 1.5 < 2
        ([3.0, 2.0], 1.4, [0], [], 0),  # 3 / 1.4 = 2.14 > 2
        ([-1.0, -1.5], 2.0, [], [0], 1),  # -1 * 2 = -2 < -1.5
        ([-1.0, -1.5], 1.4, [], [0], 0),  # -1 * 1.4 = -1.4 > -1.5
        ([1.0, 2.0], 0.4, [0], [], 0),  # < 1 rewards repeats: 1 / 0.4 = 2.5 > 2
    ],
)
def test_repetition_penalty_changes_greedy_choice(logits, penalty, prompt, output, expected):
    params = SamplingParams(temperature=0, repetition_penalty=penalty)
    assert _sample([logits], [_state(params, prompt, output)]).token_ids == [expected]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"presence_penalty": 0.6}, 1),  # 2.0 - 0.6 = 1.4 < 1.5
        ({"presence_penalty": 0.4}, 0),  # 1.6 > 1.5
        ({"frequency_penalty": 0.2}, 1),  # 2.0 - 3 * 0.2 = 1.4
        ({"frequency_penalty": 0.15}, 0),  # 1.55
        ({"frequency_penalty": 0.1, "presence_penalty": 0.25}, 1),  # 2.0 - 0.3 - 0.25 = 1.45
        ({"presence_penalty": -2.0}, 0),
    ],
)
def test_presence_frequency_change_greedy_choice(kwargs, expected):
    params = SamplingParams(temperature=0, **kwargs)
    # token 0 was generated 3 times; prompt tokens do not count for these penalties
    assert _sample([[2.0, 1.5]], [_state(params, prompt=[1, 1], output=[0, 0, 0])]).token_ids == [expected]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = [[0.0, 1.0, 9.0, 8.0, 2.0]]  # EOS=2 best, then 3
    greedy = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    assert _sample(logits, [_state(greedy, output=[])]).token_ids == [4]
    assert _sample(logits, [_state(greedy, output=[7])]).token_ids == [4]
    assert _sample(logits, [_state(greedy, output=[7, 7])]).token_ids == [2]
    no_min = SamplingParams(temperature=0, stop_token_ids=[3])
    assert _sample(logits, [_state(no_min, output=[])]).token_ids == [2]
    # ignore_eos does not matter here, as vLLM; sampled rows never draw a masked id
    sampled = SamplingParams(temperature=1.0, min_tokens=5, ignore_eos=True, stop_token_ids=[3])
    counts = _counts(logits[0], sampled, 3000, 5, output=[1, 1])
    assert counts[2] == 0 and counts[3] == 0 and counts[4] > 0


def test_seeded_reproducibility_and_different_seeds():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(temperature=1.0, seed=123)

    def run(seed):
        st = _state(params, seed=seed)
        return [_sample(logits, [st]).token_ids[0] for _ in range(100)]

    a, b, c = run(123), run(123), run(124)
    assert a == b
    assert len(set(a)) > 20  # it really samples
    assert sum(x != y for x, y in zip(a, c, strict=True)) > 50


def test_seeded_row_is_batch_invariant():
    vocab, steps = 49152, 50
    logit_gen = torch.Generator().manual_seed(5)
    step_logits = [torch.randn(vocab, generator=logit_gen) * 3 for _ in range(steps)]
    seeded = [
        SamplingParams(temperature=0.8, seed=7),
        SamplingParams(temperature=1.1, top_k=100, top_p=0.9, min_p=0.01, repetition_penalty=1.2, seed=8),
    ]
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, top_p=0.5),
        SamplingParams(temperature=1.0, top_k=7, frequency_penalty=1.0),
        SamplingParams(temperature=1.0, seed=99, min_p=0.2, min_tokens=3),
        SamplingParams(temperature=2.0, logprobs=3),
    ]

    def run(layout):  # layout: list of ("s", i) seeded / ("o", i) other rows, per step
        gens = {("s", i): torch.Generator().manual_seed(p.seed) for i, p in enumerate(seeded)}
        gens.update({("o", i): torch.Generator().manual_seed(1000 + i) for i in range(len(others))})
        outs = {key: [] for key in layout}
        noise = torch.Generator().manual_seed(6)
        for t in range(steps):
            rows, states = [], []
            for key in layout:
                kind, i = key
                params = seeded[i] if kind == "s" else others[i]
                row = step_logits[t] if kind == "s" else torch.randn(vocab, generator=noise)
                rows.append(row)
                states.append(_state(params, [1, 2, 3], outs[key], generator=gens[key]))
            out = _sample(torch.stack(rows), states)
            for key, tok in zip(layout, out.token_ids, strict=True):
                outs[key].append(tok)
        return {key: outs[key] for key in layout if key[0] == "s"}

    alone = {**run([("s", 0)]), **run([("s", 1)])}
    batched_a = run([("o", 0), ("s", 0), ("o", 1), ("o", 2), ("s", 1), ("o", 3), ("o", 4)])
    batched_b = run([("s", 1), ("o", 4), ("o", 3), ("o", 2), ("o", 1), ("o", 0), ("s", 0)])
    assert len(set(alone[("s", 0)])) > 30
    assert batched_a == alone
    assert batched_b == alone


def test_logprobs_on_a_vocab_smaller_than_n():
    out = _sample([[0.0, 2.0, 1.0]], [_state(SamplingParams(temperature=0, logprobs=20))])
    ref = torch.log_softmax(torch.tensor([0.0, 2.0, 1.0]), -1)
    assert [i for i, _ in out.logprobs[0].top] == [1, 2, 0]
    assert [v for _, v in out.logprobs[0].top] == pytest.approx(ref[[1, 2, 0]].tolist())


def test_logprobs_from_raw_logits():
    vocab = 1000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(9)) * 2
    states = [
        _state(SamplingParams(temperature=0, logprobs=5)),
        _state(SamplingParams(temperature=1.5, logprobs=20, repetition_penalty=1.5), [1, 2], seed=1),
        _state(SamplingParams(temperature=0.9, logprobs=0, presence_penalty=1.0), output=[5], seed=2),
        _state(SamplingParams(temperature=1.0), seed=3),
    ]
    ref = torch.log_softmax(logits, -1)
    ranks = []
    for _ in range(20):
        out = _sample(logits, states)
        assert out.logprobs[3] is None
        for row, n in ((0, 5), (1, 20), (2, 0)):
            lp = out.logprobs[row]
            tok = out.token_ids[row]
            assert lp.token_id == tok
            assert lp.logprob == pytest.approx(ref[row, tok].item(), abs=1e-5)
            assert lp.rank == int((ref[row] > ref[row, tok]).sum()) + 1
            assert len(lp.top) == n
            values, ids = ref[row].topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
            assert [i for i, _ in lp.top] == ids.tolist()
            assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-5)
            assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:], strict=False))
            ranks.append(lp.rank)
        assert out.logprobs[0].rank == 1 and out.logprobs[0].top[0][0] == out.token_ids[0]
    assert max(ranks) > 1  # sampled rows sometimes pick a less likely token


def test_a_top_p_below_float32_range_keeps_the_most_likely_token():
    from leanserve.sampling_params import SamplingParams
    from leanserve.worker.sampler import Sampler, SamplingState

    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    state = SamplingState(SamplingParams(temperature=1.0, top_p=5e-324), [], [], torch.Generator().manual_seed(0))
    assert Sampler(frozenset()).__call__(logits, [state]).token_ids == [1]
