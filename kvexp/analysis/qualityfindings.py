"""Findings that weigh a KV dtype's capacity and speed against its quality cost, computed from an
aggregate's runs (their `quality` blocks, KV caches and levels). Pure: nothing here prints or reads.

For each backend and model, every KV dtype with a quality block is set beside the 16-bit baseline:
its KV capacity (tokens, or bytes where the token count is fixed by -c, as on llama.cpp) relative to
the baseline's, its throughput change at the highest concurrency both measured in a scenario, and the
drift: mean (p99) KLD and top-1 agreement per context depth, and identical greedy continuations."""

from __future__ import annotations

import math
from typing import Optional

from kvexp.analysis.documents import Finding, backend_name
from kvexp.metrics.registry import is_num
from kvexp.results.blocks import Quality
from kvexp.results.runs import Aggregate, Run


def fmt_kld(v: Optional[float]) -> str:
    """A KL divergence in nats: three significant digits; 0 stays 0 (below the measurement's resolution)."""
    if v is None:
        return "—"
    return "0" if v == 0 else f"{v:.3g}"


def fmt_share(v: Optional[float]) -> str:
    """A share as a percentage: "100 %" only when it is exactly 1, else three decimals rounded down,
    so that one disagreement in ten thousand never reads as 100."""
    if v is None:
        return "—"
    if v >= 1:
        return "100 %"
    return f"{math.floor(v * 100_000) / 1000:.3f} %"


def _kv(run: Run) -> str:
    return str((run.quality.kv if run.quality is not None else None) or run.kv_requested or "")


def _like(a: Run, b: Run) -> bool:
    """Two runs whose KV caches may be compared: the same scenario and the same number of slots (a
    server sized for 16 sequences holds more tokens than one sized for 2, whatever its dtype)."""
    return a.scenario == b.scenario and a.kv_cache.seqs == b.kv_cache.seqs


def _capacity(runs: list[Run], kv: str, like: Run) -> tuple[Optional[float], Optional[float]]:
    """(capacity tokens, KV bytes) of the first run of this KV dtype, comparable with `like`, that reported them."""
    same = [r for r in runs if _kv(r) == kv and _like(r, like)]
    tokens = next((r.kv_cache.capacity_tokens for r in same if is_num(r.kv_cache.capacity_tokens)), None)
    size = next((r.kv_cache.bytes for r in same if is_num(r.kv_cache.bytes)), None)
    return tokens, size


def _capacity_words(runs: list[Run], kv: str, base: str, like: Run) -> Optional[str]:
    t, b = _capacity(runs, kv, like)
    t0, b0 = _capacity(runs, base, like)
    if t and t0 and t != t0:
        return f"{t / t0:.2f}× KV capacity ({int(t):,} vs {int(t0):,} tokens)"
    if b and b0:
        return f"{b / b0:.2f}× KV memory for the same tokens"
    return None


def _speed_words(runs: list[Run], kv: str, base: str) -> Optional[str]:
    """Throughput change at the highest level both dtypes measured in one scenario."""
    best = None
    for scen in sorted({str(r.scenario) for r in runs}):
        a = next((r for r in runs if str(r.scenario) == scen and _kv(r) == kv and r.levels), None)
        b = next((r for r in runs if str(r.scenario) == scen and _kv(r) == base and r.levels), None)
        if a is None or b is None:
            continue
        ta = {lv.x: lv.number("throughput_tok_s") for lv in a.merged_levels() if a.usable(lv)}
        tb = {lv.x: lv.number("throughput_tok_s") for lv in b.merged_levels() if b.usable(lv)}
        common = [x for x in ta if x in tb and x is not None and ta[x] and tb[x]]
        if common:
            x = max(common, key=lambda k: k[1])
            cand = (x[1], scen, (ta[x] - tb[x]) / tb[x] * 100, x[0])
            best = cand if best is None or cand[0] > best[0] else best
    if best is None:
        return None
    xv, scen, pct, kind = best
    where = f"c={xv:g}" if kind == "concurrency" else f"{xv:g} req/s"
    return f"{pct:+.0f} % throughput at {where} ({scen})"


def _drift_words(q: Quality) -> Optional[str]:
    depths = q.ok_depths
    if not depths:
        return None
    first, rest = depths[0], depths[1:]
    s = f"mean KLD {fmt_kld(first.kld_mean)}"
    if is_num(first.kld_p99):
        s += f" (p99 {fmt_kld(first.kld_p99)})"
    if is_num(first.top1_agreement):
        s += f", top-1 agreement {fmt_share(first.top1_agreement)}"
    s += f" at depth {first.context}"
    if rest:
        s += " (" + ", ".join(f"{fmt_kld(d.kld_mean)} at {d.context}" for d in rest) + ")"
    return s


def _continuation_words(q: Quality) -> Optional[str]:
    share, n = q.continuation.identical_share, q.continuation.prompts
    if not is_num(share) or not n:
        return None
    return f"{round(share * n)}/{n} greedy continuations identical"  # type: ignore[operator]


def quality_findings(aggregate: Aggregate) -> list[Finding]:
    """One `quality_trade` finding per non-baseline KV dtype with a quality block, and a
    `quality_nondeterministic` one per baseline that did not reproduce itself."""
    groups: dict[tuple[str, str], list[Run]] = {}
    for r in aggregate.runs:
        groups.setdefault((str(r.backend), str(r.model)), []).append(r)
    out: list[Finding] = []
    for (backend, _model), group in groups.items():
        seen: set[str] = set()
        for r in group:
            q = r.quality
            if q is None or _kv(r) in seen:
                continue
            seen.add(_kv(r))
            base = str(q.baseline.kv or "")
            det = q.determinism
            if det.deterministic is False:
                out.append(Finding(
                    "quality_nondeterministic",
                    f"{backend_name(backend)}: the {base} baseline did not reproduce itself ({det.summary}): "
                    f"{r.label}'s drift figures include that nondeterminism.",
                    str(r.scenario), (r.label,), {"determinism": det.to_json()}))
            if _kv(r) == base:
                continue
            parts = [p for p in (_capacity_words(group, _kv(r), base, r), _speed_words(group, _kv(r), base),
                                 _drift_words(q), _continuation_words(q)) if p]
            if not parts:
                continue
            out.append(Finding(
                "quality_trade",
                f"{backend_name(backend)} {_kv(r)} KV vs {base}: " + ", ".join(parts) + f" ({r.label}).",
                str(r.scenario), (r.label,),
                {"kv": _kv(r), "baseline_kv": base, "depths": [d.to_json() for d in q.ok_depths],
                 "continuation": q.continuation.to_json()}))
    return out
