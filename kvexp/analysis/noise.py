"""Is a difference between two configurations real? A difference is called one only when it exceeds
the noise that was measured; otherwise it is "no measurable difference", and the sentence says which
test decided:

- repeats (both levels measured two or more times): the two 95 % confidence intervals of the repeats'
  mean (Student's t, stats.repeat_summary) do not overlap;
- machine load: runs whose load average or CPU steal differed (conditions.py) are never called
  measurably different, whatever the figures: the lead may be the machine's;
- no repeats: the relative difference exceeds both MIN_EFFECT (5 %) and the noise the levels' own
  dispersion implies: the per-request spread (p95 - p50) / 1.645 of the figure's latency (TPOT for
  throughput, TTFT for TTFT), relative to its p50, as a standard error over the level's requests,
  for the two levels together at 95 % (1.96 x sqrt(se_a^2 + se_b^2)).

Pure: takes runs and levels of the aggregate shape, returns a Verdict."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from kvexp.analysis import conditions
from kvexp.metrics import registry
from kvexp.metrics.levels import Level
from kvexp.metrics.stats import repeat_summary
from kvexp.results.runs import Run

MIN_EFFECT = 0.05  # the smallest relative difference called a difference without repeats
# A threshold above this is no threshold a reader can act on: the level is too dispersed to compare.
MAX_THRESHOLD_PCT = 100.0
DISPERSED = ("a level too dispersed to compare: run scenario.repeats=3 or more requests per level "
             "(scenario.requests)")
Z95 = 1.96
Z_P95 = 1.645  # a normal distribution's p95 lies 1.645 sd above its median

@dataclass(frozen=True)
class Verdict:
    """a, b: the two figures compared (means where repeated); measurable: the difference exceeds the
    noise; basis: "repeats" or "minimum effect"; threshold_pct: the relative difference needed (minimum
    effect) or None (repeats); ci_a / ci_b: the repeats' 95 % half-widths."""

    metric: str
    a: float
    b: float
    measurable: bool
    basis: str
    diff_pct: Optional[float]
    threshold_pct: Optional[float] = None
    ci_a: Optional[float] = None
    ci_b: Optional[float] = None
    conditions: Optional[str] = None  # basis "machine load": the two runs' load, in words

    @property
    def dispersed(self) -> bool:
        """Without repeats, a level's own spread implies a threshold above MAX_THRESHOLD_PCT."""
        return self.threshold_pct is not None and self.threshold_pct > MAX_THRESHOLD_PCT

    @property
    def label(self) -> str:
        if self.dispersed:
            return "not comparable"
        return "a measurable difference" if self.measurable else "no measurable difference"

    @property
    def reason(self) -> str:
        """Why, in words: which noise the difference was held against."""
        unit = registry.metric(self.metric).unit
        if self.basis == "machine load":
            return f"not comparable: the machine's load differed between the runs ({self.conditions})"
        if self.basis == "repeats":
            ci = f"{self.a:.1f} ± {self.ci_a:.1f} vs {self.b:.1f} ± {self.ci_b:.1f} {unit}".rstrip()
            return f"the repeats' 95 % CIs {'do not overlap' if self.measurable else 'overlap'}: {ci}"
        diff = "—" if self.diff_pct is None else f"{self.diff_pct:+.1f} %"
        if self.dispersed:
            return f"{diff}, but {DISPERSED}"
        return (f"{diff} {'exceeds' if self.measurable else 'is within'} the noise threshold of "
                f"{self.threshold_pct:.1f} %: without repeats, the larger of a {MIN_EFFECT * 100:.0f} % minimum "
                f"effect and the levels' own dispersion")

    @property
    def phrase(self) -> str:
        return f"{self.label} ({self.reason})"

    def numbers(self) -> dict[str, Any]:
        return {"measurable": self.measurable, "noise_basis": self.basis, "noise_threshold_pct": self.threshold_pct,
                "ci95_a": self.ci_a, "ci95_b": self.ci_b}


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def repeat_values(run: Run, level: Level, metric: str) -> list[float]:
    """The metric in every repeat of this level that did not fail (the run's level entries at its x)."""
    x = level.x
    if x is None:
        return []
    return [v for lv in run.levels if lv.x == x and not lv.failed and (v := lv.number(metric)) is not None]


def relative_se(level: Level, metric: str) -> Optional[float]:
    """The level's own relative standard error for a figure, from its latency spread (None: unknown)."""
    kind = registry.metric(metric).spread
    p50, p95, n = level.value(f"{kind}_p50_ms"), level.value(f"{kind}_p95_ms"), level.requests
    if not kind or not (_is_num(p50) and _is_num(p95) and _is_num(n)) or p50 <= 0 or n < 1:
        return None
    errors = level.errors if _is_num(level.errors) else 0
    ok = max(1.0, float(n) - float(errors))
    return max(0.0, p95 - p50) / Z_P95 / p50 / math.sqrt(ok)


def compare(run_a: Run, level_a: Level, run_b: Run, level_b: Level, metric: str = "throughput_tok_s"
            ) -> Optional[Verdict]:
    """Whether level_a's metric differs measurably from level_b's (None when either lacks it)."""
    load = conditions.load_difference(run_a, run_b)
    if load is not None:
        a, b = level_a.value(metric), level_b.value(metric)
        if not (_is_num(a) and _is_num(b)):
            return None
        return Verdict(metric, float(a), float(b), False, "machine load", (a - b) / b * 100 if b else None,
                       conditions=load)
    ra, rb = repeat_values(run_a, level_a, metric), repeat_values(run_b, level_b, metric)
    if len(ra) >= 2 and len(rb) >= 2:
        sa, sb = repeat_summary(ra), repeat_summary(rb)
        ma, mb, ha, hb = sa["mean"], sb["mean"], sa["ci95"], sb["ci95"]  # type: ignore[index]
        diff = (ma - mb) / mb * 100 if mb else None
        return Verdict(metric, ma, mb, abs(ma - mb) > ha + hb, "repeats", diff, None, ha, hb)
    a, b = level_a.value(metric), level_b.value(metric)
    if not (_is_num(a) and _is_num(b)):
        return None
    diff = (a - b) / b * 100 if b else None
    ses = [s for s in (relative_se(level_a, metric), relative_se(level_b, metric)) if s is not None]
    dispersion = Z95 * math.sqrt(sum(s * s for s in ses)) if len(ses) == 2 else 0.0
    threshold = max(MIN_EFFECT, dispersion) * 100
    return Verdict(metric, float(a), float(b), diff is not None and abs(diff) > threshold, "minimum effect",
                   diff, threshold)
