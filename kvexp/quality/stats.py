"""Pure maths of quality measurements: how far a KV dtype moves a model's next-token distributions
from the 16-bit KV cache's. No I/O; the measuring modules of kvexp/quality gather the numbers and
this module reduces them.

Definitions (nats throughout; P is the baseline's next-token distribution, Q the candidate's, at the
same position of the same token sequence):
- KL divergence KLD(P || Q) = sum_i P_i (log P_i - log Q_i), per position; figures are its mean,
  median, 99th percentile and maximum over the scored positions.
- Where only the top k log-probabilities are exposed (vLLM's prompt_logprobs / logprobs), the sum
  runs over the baseline's top k plus one bucket "everything else" (mass 1 - sum of those k, on
  each side). Merging outcomes into one bucket can only lower a KL divergence, so when every one of
  the baseline's top k is also in the candidate's top k the figure is a lower bound on the full
  KLD; a baseline top-k token outside the candidate's top k is given the candidate's k-th
  probability (an upper bound on its true probability), and such positions are counted.
- Top-1 agreement: share of positions where both distributions' most likely token is the same.
- Perplexity: exp(mean negative log-likelihood of the text's next token).
- Greedy continuation agreement, over N prompts continued at temperature 0 by both: the share of
  continuations identical token for token; the mean position (0-based, in generated tokens) of the
  first differing token over the continuations that differ; and prefix agreement, the share of all
  generated tokens that come before the first difference (identical continuations count whole).
  After a difference the two continue from different text, so nothing after it is compared."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from kvexp.metrics.stats import percentile

# The smallest mean KLD the figures resolve: llama-perplexity prints the mean KLD with 6 decimals,
# and its base file stores log-probabilities in 16 bits over a 16-nat range (steps of 2.4e-4 nats).
DETERMINISM_KLD = 1e-6


@dataclass(frozen=True)
class TopK:
    """One position's top-k log-probabilities (token id -> logprob), best first."""

    logprobs: Mapping[int, float]

    def top1(self) -> Optional[int]:
        return max(self.logprobs, key=self.logprobs.__getitem__) if self.logprobs else None


def topk_kld(base: TopK, cand: TopK) -> tuple[float, bool]:
    """KLD(P_base || Q_cand) over the baseline's top k plus a rest bucket; (value, exact_support):
    exact_support is False when a baseline top-k token was missing from the candidate's top k
    (its probability then taken as the candidate's k-th, an upper bound). Never negative."""
    if not base.logprobs or not cand.logprobs:
        raise ValueError("topk_kld: both positions need at least one log-probability")
    floor = min(cand.logprobs.values())
    exact = True
    kld = 0.0
    p_sum = q_sum = 0.0
    for tok, lp in base.logprobs.items():
        lq = cand.logprobs.get(tok)
        if lq is None:
            exact, lq = False, floor
        p, q = math.exp(lp), math.exp(lq)
        p_sum += p
        q_sum += q
        kld += p * (lp - lq)
    p_rest, q_rest = max(0.0, 1.0 - p_sum), max(0.0, 1.0 - q_sum)
    if p_rest > 1e-12:
        kld += p_rest * (math.log(p_rest) - math.log(max(q_rest, 1e-12)))
    return max(0.0, kld), exact


@dataclass(frozen=True)
class DriftSummary:
    """Teacher-forced drift over the scored positions of one context depth."""

    positions: int
    kld_mean: Optional[float]
    kld_median: Optional[float]
    kld_p99: Optional[float]
    kld_max: Optional[float]
    top1_agreement: Optional[float]  # 0..1
    ppl_base: Optional[float]
    ppl: Optional[float]
    inexact_positions: int = 0  # top-k only: positions whose baseline top k was not all in the candidate's

    @property
    def delta_ppl(self) -> Optional[float]:
        return None if self.ppl is None or self.ppl_base is None else self.ppl - self.ppl_base


def perplexity(nll: Sequence[float]) -> Optional[float]:
    """exp(mean negative log-likelihood); None for no positions."""
    return math.exp(sum(nll) / len(nll)) if nll else None


def summarize_drift(klds: Sequence[float], top1_same: Sequence[bool], nll_base: Sequence[float],
                    nll: Sequence[float], inexact: int = 0) -> DriftSummary:
    n = len(klds)
    if not n:
        return DriftSummary(0, None, None, None, None, None, perplexity(nll_base), perplexity(nll), inexact)
    s = sorted(klds)
    return DriftSummary(
        positions=n, kld_mean=sum(s) / n, kld_median=percentile(s, 50), kld_p99=percentile(s, 99),
        kld_max=s[-1], top1_agreement=sum(top1_same) / len(top1_same) if top1_same else None,
        ppl_base=perplexity(nll_base), ppl=perplexity(nll), inexact_positions=inexact)


def drift(base: Sequence[TopK], cand: Sequence[TopK], targets: Sequence[int]) -> DriftSummary:
    """Teacher-forced drift from per-position top-k log-probabilities of the same token sequence:
    base[i] and cand[i] predict targets[i]. Perplexity counts only positions whose target is in the
    exposed log-probabilities on both sides (vLLM always adds the actual token to prompt_logprobs)."""
    if not (len(base) == len(cand) == len(targets)):
        raise ValueError(f"drift: {len(base)} baseline, {len(cand)} candidate positions and "
                         f"{len(targets)} targets must be as many")
    klds, same, nb, nq, inexact = [], [], [], [], 0
    for b, c, t in zip(base, cand, targets):
        k, exact = topk_kld(b, c)
        klds.append(k)
        inexact += not exact
        same.append(b.top1() == c.top1())
        if t in b.logprobs and t in c.logprobs:
            nb.append(-b.logprobs[t])
            nq.append(-c.logprobs[t])
    return summarize_drift(klds, same, nb, nq, inexact)


@dataclass(frozen=True)
class ContinuationAgreement:
    prompts: int
    identical_share: Optional[float]  # 0..1
    first_diff_mean: Optional[float]  # over the continuations that differ; None when none differs
    prefix_agreement: Optional[float]  # generated tokens before the first difference / all generated


def first_difference(a: Sequence, b: Sequence) -> Optional[int]:
    """Index of the first position where a and b differ (a length difference counts at the end of
    the shorter); None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def continuation_agreement(base: Sequence[Sequence], cand: Sequence[Sequence]) -> ContinuationAgreement:
    """Agreement of greedy continuations prompt by prompt (base[i] and cand[i] continue prompt i)."""
    if len(base) != len(cand):
        raise ValueError(f"continuation_agreement: {len(base)} baseline and {len(cand)} candidate "
                         "continuations must be as many")
    if not base:
        return ContinuationAgreement(0, None, None, None)
    diffs = [first_difference(b, c) for b, c in zip(base, cand)]
    differing = [d for d in diffs if d is not None]
    total = sum(len(b) for b in base)
    before = sum(len(b) if d is None else d for b, d in zip(base, diffs))
    return ContinuationAgreement(
        prompts=len(base), identical_share=(len(base) - len(differing)) / len(base),
        first_diff_mean=sum(differing) / len(differing) if differing else None,
        prefix_agreement=before / total if total else None)


def deterministic(kld_mean: Optional[float], top1: Optional[float], identical: Optional[float]) -> Optional[bool]:
    """Whether a baseline measured against itself agrees with itself (None: nothing was measured):
    mean KLD at most DETERMINISM_KLD, top-1 agreement and identical continuations 100 %."""
    checks = []
    if kld_mean is not None:
        checks.append(kld_mean <= DETERMINISM_KLD)
    if top1 is not None:
        checks.append(top1 >= 1.0)
    if identical is not None:
        checks.append(identical >= 1.0)
    return all(checks) if checks else None
