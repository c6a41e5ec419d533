"""End to end, speculative sampling keeps the target model's distribution (Leviathan et al. 2023, Theorem 1).

At temperature 1 and top_p 0.9 on a prompt where the model is uncertain and the n-gram proposer drafts often,
2,000 seeded samples with speculation and 2,000 without (other seeds) give token distributions that a
two-sample chi-square test cannot tell apart (p > 0.01), at each of the first generated positions and jointly
over the first two; the same test does tell a different temperature apart, so it has the power to fail.
"""

from __future__ import annotations

from collections import Counter

from leanserve import LLM, SamplingParams
from leanserve.loader import load_model

import pytest
import torch

from tests.conftest import assert_no_leaks

PROMPT = "Pick random words: cat, sun, tree, cat, sun, tree, cat, sun, tree, cat,"
N = 2000
MAX_TOKENS = 3
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}


def chi_square_p(a: Counter, b: Counter, min_expected: float = 5.0) -> float:
    """p-value of Pearson's chi-square test that two samples come from one distribution (a 2 x K table).

    Categories whose pooled expected count is under ``min_expected`` in either row are merged into one."""
    na, nb = sum(a.values()), sum(b.values())
    keys = sorted(set(a) | set(b))
    small = [k for k in keys if (a[k] + b[k]) * min(na, nb) / (na + nb) < min_expected]
    cats = [(a[k], b[k]) for k in keys if k not in small]
    if small:
        cats.append((sum(a[k] for k in small), sum(b[k] for k in small)))
    stat = 0.0
    for ca, cb in cats:
        tot = ca + cb
        for obs, n in ((ca, na), (cb, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    df = len(cats) - 1
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def sample(llm: LLM, seed0: int, temperature: float = 1.0, n: int = N) -> list[tuple[int, ...]]:
    params = [SamplingParams(temperature=temperature, top_p=0.9, seed=seed0 + i, max_tokens=MAX_TOKENS,
                             ignore_eos=True) for i in range(n)]
    return [tuple(o.outputs[0].token_ids) for o in llm.generate([PROMPT] * n, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def samples():
    kw = {"loaded": load_model(None, quantization="auto"), "kv_cache_memory": 256 << 20, "max_num_seqs": 256}
    base = LLM(**kw)
    spec = LLM(speculative_config=SPEC, **kw)
    plain, speculated = sample(base, 0), sample(spec, 1_000_000)
    stats = spec.engine.get_stats()
    assert_no_leaks(spec.engine)
    return base, plain, speculated, stats


def test_speculation_drafted_and_the_model_is_uncertain(samples):
    _, plain, _, stats = samples
    assert stats.spec_num_drafts > N // 2 and stats.spec_num_accepted_tokens > N // 4
    for pos in range(MAX_TOKENS):  # no position is nearly deterministic, or the test would have no power
        assert Counter(s[pos] for s in plain).most_common(1)[0][1] < 0.8 * N


@pytest.mark.parametrize("pos", range(MAX_TOKENS))
def test_each_position_has_the_same_distribution(samples, pos):
    _, plain, speculated, _ = samples
    assert chi_square_p(Counter(s[pos] for s in plain), Counter(s[pos] for s in speculated)) > 0.01


def test_the_first_two_tokens_jointly_have_the_same_distribution(samples):
    _, plain, speculated, _ = samples
    assert chi_square_p(Counter(s[:2] for s in plain), Counter(s[:2] for s in speculated)) > 0.01


def test_the_test_tells_another_temperature_apart(samples):
    base, plain, _, _ = samples
    colder = sample(base, 2_000_000, temperature=0.6, n=N // 2)
    assert chi_square_p(Counter(s[:2] for s in plain), Counter(s[:2] for s in colder)) < 0.01
