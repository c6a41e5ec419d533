"""Speculative sampling's accept/reject rule (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling").

Draft token x_i, proposed with probability q_i(x_i), is accepted with probability min(1, p_i(x_i) / q_i(x_i)),
where p_i is the target's distribution at that position; at the first rejection the output token is drawn from
norm(max(0, p_i - q_i)) and the run ends; when all k drafts are accepted a bonus token is drawn from p_{k+1}. The
output then has exactly the target's distribution, whatever q is.

For a deterministic proposer (n-gram: q_i is one-hot at x_i) the rule reduces to: draw y_i ~ p_i and accept while
y_i == x_i; the first y_i that differs is the token drawn from norm(max(0, p_i - q_i)) = p_i without x_i. The model
runner uses that form (:func:`accept_one_hot`), so a step that accepts everything draws exactly the uniforms k + 1
plain decode steps would.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def rejection_sample(p: torch.Tensor, q: torch.Tensor, draft: Sequence[int], generator: torch.Generator | None
                     ) -> list[int]:
    """Accepted drafts plus one more token, for one request.

    Args:
        p: [k + 1, vocab] float target probabilities (rows sum to 1) at the k draft positions and the bonus one.
        q: [k, vocab] float draft probabilities the drafts were drawn from.
        draft: the k proposed token ids.
        generator: the request's RNG (None: torch's global one).

    Returns:
        ``draft[:a] + [y]``: the a accepted drafts and the corrected (or bonus) token y; 1 to k + 1 ids.

    Raises:
        ValueError: shapes that do not match ``draft``.
    """
    k = len(draft)
    if p.dim() != 2 or q.dim() != 2 or p.shape[0] != k + 1 or q.shape[0] != k or p.shape[1] != q.shape[1]:
        raise ValueError(f"p {tuple(p.shape)} and q {tuple(q.shape)} do not fit {k} drafts")
    out: list[int] = []
    for i, x in enumerate(draft):
        px, qx = float(p[i, x]), float(q[i, x])
        u = torch.rand((), dtype=torch.float64, generator=generator).item()
        if qx > 0 and u < min(1.0, px / qx):
            out.append(int(x))
            continue
        residual = (p[i] - q[i]).clamp_(min=0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: any p-draw is exact
            residual = p[i].clone()
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[k], 1, generator=generator)))
    return out


def accept_one_hot(sampled: Sequence[int], draft: Sequence[int]) -> int:
    """How many drafts a deterministic proposal keeps: the length of the common prefix of ``draft`` (k ids) and
    ``sampled`` (k + 1 ids, one drawn from the target at each position). The output is
    ``sampled[:a + 1]`` (= ``draft[:a]`` plus the target's own token at position a)."""
    a = 0
    for x, y in zip(draft, sampled, strict=False):
        if x != y:
            break
        a += 1
    return a
