"""SLO search: the highest concurrency (or request rate) whose levels meet the scenario's latency
objectives, found by measuring a few levels of the grid instead of all of them.

The grid is the scenario's levels (scenario.concurrency or scenario.rates), filled every
`scenario.search_resolution` between its lowest and highest when that is set. The search:

1. ramps: the lowest level first, then the smallest level at least `SEARCH_FACTOR` (2) times the
   last one, until a level misses an objective;
2. bisects the grid between the last level that met them and the first that missed, until the two
   are neighbours on the grid (the resolution);
3. stops early when throughput stopped growing on the ramp (less than MIN_GROWTH, 5 %, over the
   previous level: further levels would only queue), when a level preempts, or when a level's error
   rate passes scenario.max_error_rate.

A level meets the objectives when its TTFT and TPOT at the scenario's percentile (slo_percentile,
default p95; the mean over its repeats) are at most slo_ttft_ms / slo_tpot_ms, it did not fail, and it
did not preempt. The answer is the highest level that met them; levels above a missed one are never
probed. Pure: `next_step` reads the levels measured so far and says what to measure next or why
to stop; the runner measures, this module decides."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

if TYPE_CHECKING:
    from kvexp.metrics.levels import Level

SEARCH_FACTOR = 2.0
MIN_GROWTH = 0.05
PERCENTILES = ("p50", "p95", "p99")
KINDS = ("concurrency", "rate")

# Why a search stopped (result["search"]["stop_reason"]).
STOP_RESOLUTION = "resolution"  # last pass and first miss are neighbours on the grid
STOP_TOP = "grid_top_passes"  # the highest level of the grid meets the objectives
STOP_BOTTOM = "lowest_level_misses"  # the lowest level misses: nothing meets the objectives
STOP_PLATEAU = "throughput_stopped_growing"
STOP_PREEMPTION = "preemptions_began"
STOP_ERRORS = "errors_passed_max_error_rate"


@dataclass(frozen=True)
class Objectives:
    """What the search holds each level to (from the scenario)."""

    kind: str  # concurrency | rate
    slo_ttft_ms: Optional[float]
    slo_tpot_ms: Optional[float]
    percentile: str = "p95"
    max_error_rate: float = 0.1
    min_growth: Optional[float] = MIN_GROWTH  # None: never stop on a plateau
    factor: float = SEARCH_FACTOR


@dataclass(frozen=True)
class Probe:
    """One measured level as the search sees it (all its repeats together)."""

    x: float
    passed: bool
    ttft_ms: Optional[float]
    tpot_ms: Optional[float]
    throughput_tok_s: Optional[float]
    preemptions: Optional[float]
    error_rate: Optional[float]
    failed: bool
    misses: tuple[str, ...] = ()  # which objectives it missed: "ttft", "tpot", "failed", "preemptions"

    def to_json(self) -> dict[str, Any]:
        return {"x": self.x, "passed": self.passed, "ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms,
                "throughput_tok_s": self.throughput_tok_s, "preemptions": self.preemptions,
                "error_rate": self.error_rate, "misses": list(self.misses)}


@dataclass(frozen=True)
class Step:
    """Measure `x` next, or stop (x None) for `stop_reason`, with the answer and its brackets."""

    x: Optional[float]
    stop_reason: Optional[str] = None
    answer: Optional[float] = None
    last_pass: Optional[float] = None
    first_fail: Optional[float] = None
    detail: Optional[str] = None
    probes: tuple[Probe, ...] = field(default_factory=tuple)


def grid(values: Iterable[float], resolution: Optional[float] = None, integer: bool = True) -> list[float]:
    """The sorted levels the search may probe: the given ones, filled every `resolution` between the
    lowest and the highest (integers for concurrency)."""
    xs = sorted({float(v) for v in values})
    if resolution and xs:
        n = int(math.floor((xs[-1] - xs[0]) / resolution + 1e-9))
        xs = sorted(set(xs) | {round(xs[0] + i * resolution, 9) for i in range(n + 1)})
    return sorted({float(round(x)) for x in xs}) if integer else xs


def _mean(values: Sequence[Optional[float]]) -> Optional[float]:
    xs = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return statistics.fmean(xs) if xs else None


def evaluate(x: float, levels: Sequence[Level], obj: Objectives) -> Probe:
    """A Probe from a level's entries (its repeats): percentiles averaged over the repeats."""
    p = obj.percentile
    ttft = _mean([lv.value(f"ttft_{p}_ms") for lv in levels])
    tpot = _mean([lv.value(f"tpot_{p}_ms") for lv in levels])
    tput = _mean([lv.throughput_tok_s for lv in levels])
    pre = [lv.preemptions for lv in levels if isinstance(lv.preemptions, (int, float))]
    requests = sum(int(lv.requests or 0) for lv in levels)
    errors = sum(int(lv.errors or 0) for lv in levels)
    error_rate = errors / requests if requests else None
    failed = any(lv.failed for lv in levels)
    misses = []
    if obj.slo_ttft_ms is not None and (ttft is None or ttft > obj.slo_ttft_ms):
        misses.append("ttft")
    if obj.slo_tpot_ms is not None and (tpot is None or tpot > obj.slo_tpot_ms):
        misses.append("tpot")
    if failed or (error_rate is not None and error_rate > obj.max_error_rate):
        misses.append("errors")
    if pre and sum(pre) > 0:
        misses.append("preemptions")
    return Probe(x, not misses, ttft, tpot, tput, sum(pre) if pre else None, error_rate, failed, tuple(misses))


def _fmt(x: Optional[float]) -> str:
    return "none" if x is None else f"{x:g}"


def next_step(candidates: Sequence[float], probes: Sequence[Probe], obj: Objectives) -> Step:
    """What to measure next, from the grid and the levels measured so far (in the order measured)."""
    cands = sorted(set(candidates))
    if not cands:
        return Step(None, STOP_BOTTOM, detail="the grid is empty")
    done = {p.x: p for p in probes}
    passes = sorted(p.x for p in probes if p.passed)
    fails = sorted(p.x for p in probes if not p.passed)
    first_fail = fails[0] if fails else None
    below = [x for x in passes if first_fail is None or x < first_fail]
    last_pass = below[-1] if below else None

    def stop(reason: str, detail: str) -> Step:
        return Step(None, reason, last_pass, last_pass, first_fail, detail, tuple(probes))

    if not probes:
        return Step(cands[0], probes=())
    latest = probes[-1]
    if "errors" in latest.misses:
        rate = "—" if latest.error_rate is None else f"{latest.error_rate:.0%}"
        return stop(STOP_ERRORS, f"{obj.kind} {_fmt(latest.x)}: error rate {rate} passed "
                                 f"max_error_rate {obj.max_error_rate:.0%}")
    if "preemptions" in latest.misses:
        return stop(STOP_PREEMPTION, f"{obj.kind} {_fmt(latest.x)}: {latest.preemptions:g} preemptions")
    if first_fail is None:  # still ramping
        prev = probes[-2] if len(probes) >= 2 else None
        if (obj.min_growth is not None and prev is not None and prev.throughput_tok_s
                and latest.throughput_tok_s is not None
                and latest.throughput_tok_s < prev.throughput_tok_s * (1 + obj.min_growth)):
            growth = (latest.throughput_tok_s - prev.throughput_tok_s) / prev.throughput_tok_s * 100
            return stop(STOP_PLATEAU, f"throughput {prev.throughput_tok_s:.1f} -> {latest.throughput_tok_s:.1f} "
                                      f"tok/s from {obj.kind} {_fmt(prev.x)} to {_fmt(latest.x)} "
                                      f"({growth:+.1f} %, under {obj.min_growth:.0%})")
        top = max(done)
        nxt = next((c for c in cands if c >= top * obj.factor and c not in done), None)
        if nxt is None:
            nxt = next((c for c in reversed(cands) if c > top and c not in done), None)
        if nxt is None:
            return stop(STOP_TOP, f"the highest level of the grid, {obj.kind} {_fmt(top)}, meets the objectives")
        return Step(nxt, probes=tuple(probes))
    if last_pass is None:
        return stop(STOP_BOTTOM, f"the lowest level probed, {obj.kind} {_fmt(first_fail)}, misses "
                                 f"{', '.join(done[first_fail].misses)}")
    between = [c for c in cands if last_pass < c < first_fail and c not in done]
    if not between:
        return stop(STOP_RESOLUTION, f"{obj.kind} {_fmt(last_pass)} meets the objectives and "
                                     f"{_fmt(first_fail)}, its neighbour on the grid, misses "
                                     f"{', '.join(done[first_fail].misses)}")
    return Step(between[(len(between) - 1) // 2], probes=tuple(probes))


def grid_answer(probes: Sequence[Probe]) -> Optional[float]:
    """The answer a full grid gives: the highest level below the first one that misses (None if the
    lowest misses)."""
    ordered = sorted(probes, key=lambda p: p.x)
    ans = None
    for p in ordered:
        if not p.passed:
            break
        ans = p.x
    return ans


def result_block(step: Step, obj: Objectives, candidates: Sequence[float], measure_s: Optional[float]) -> dict[str, Any]:
    """result["search"] (schema/result.schema.json): the answer, its brackets, why the search stopped,
    every probe in the order measured, the grid and the objectives."""
    return {
        "kind": obj.kind,
        "answer": step.answer,
        "last_pass": step.last_pass,
        "first_fail": step.first_fail,
        "stop_reason": step.stop_reason,
        "detail": step.detail,
        "objectives": {"slo_ttft_ms": obj.slo_ttft_ms, "slo_tpot_ms": obj.slo_tpot_ms,
                       "percentile": obj.percentile, "max_error_rate": obj.max_error_rate,
                       "min_growth": obj.min_growth, "factor": obj.factor},
        "grid": list(candidates),
        "probed": [p.to_json() for p in step.probes],
        "measure_s": measure_s,
    }


class Search:
    """The runner's side of a search: iterate to get the next (kind, value) to measure; `levels`
    returns the job's levels so far (read after each measured level); `step` is the last decision."""

    def __init__(self, obj: Objectives, candidates: Sequence[float], levels: Any):
        self.obj, self.candidates, self.levels = obj, list(candidates), levels
        self.step: Optional[Step] = None
        self.asked: list[float] = []  # levels in the order this search asked for them

    def probes(self) -> list[Probe]:
        """The measured levels as probes, in the order measured (levels kept from an earlier run of
        the job first, by value)."""
        by_x: dict[float, list[Level]] = {}
        for lv in self.levels():
            if lv.value(self.obj.kind) is not None:
                by_x.setdefault(float(lv.value(self.obj.kind)), []).append(lv)
        order = sorted(x for x in by_x if x not in self.asked) + [x for x in self.asked if x in by_x]
        return [evaluate(x, by_x[x], self.obj) for x in order]

    def __iter__(self):
        while True:
            self.step = next_step(self.candidates, self.probes(), self.obj)
            if self.step.x is None or self.step.x in self.asked:  # asked and still unmeasured: stop
                return
            self.asked.append(self.step.x)
            yield self.obj.kind, (int(self.step.x) if self.obj.kind == "concurrency" else self.step.x)


def objectives(scenario: Any) -> Optional[Objectives]:
    """The search a scenario asks for (None: scenario.search is not set)."""
    kind = getattr(scenario, "search", None)
    if not kind:
        return None
    return Objectives(kind, scenario.slo_ttft_ms, scenario.slo_tpot_ms, scenario.slo_percentile,
                      scenario.max_error_rate, scenario.search_min_growth)


def scenario_grid(scenario: Any) -> list[float]:
    values = scenario.concurrency if scenario.search == "concurrency" else scenario.rates
    return grid(values, scenario.search_resolution, integer=scenario.search == "concurrency")
