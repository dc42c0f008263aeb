"""What a comparison shows, computed from an aggregate: pure functions that return small dataclasses.

Nothing here prints, plots or reads files. Each `Finding` (documents.py) carries one sentence for the
report and the numbers behind it: the best configuration per level and overall (called only where it
beats the measured noise, noise.py), what a KV dtype gains, where throughput saturates, where
preemption starts against the planner's prediction, what was not exposed, what failed.

Missing is None throughout: a level without a value is skipped, never treated as 0."""

from __future__ import annotations

from typing import Iterable, Optional

from kvexp.analysis import noise
from kvexp.analysis.conditions import setup_difference
from kvexp.analysis.card import card_findings, kv_cards
from kvexp.analysis.comparable import partition
from kvexp.analysis.documents import Finding, backend_name, first_line, fmt_x, x_words
from kvexp.analysis.qualityfindings import quality_findings
from kvexp.analysis.runplan import RunPlan, run_plan
from kvexp.capacity.planner import KV_BYTES_PER_ELEMENT
from kvexp.metrics.levels import Level
from kvexp.metrics.registry import format_value, is_num
from kvexp.results.runs import Aggregate, Run

# Short spellings seen in other tools' labels, beside planner.KV_BYTES_PER_ELEMENT's.
_KV_ALIASES = {"q8": "q8_0", "q4": "q4_0", "auto": "fp16"}


def _pct_change(new: float, old: float) -> Optional[float]:
    return (new - old) / old * 100 if old else None


def _signed(p: float) -> str:
    return f"{p:+.1f} %"


# Thresholds for "throughput stopped growing" (those for unstable levels live in levels.py).
SATURATION_TPUT_GROWTH = 0.10  # throughput grows less than this between two levels ...


SATURATION_TTFT_GROWTH = 0.50  # ... while TTFT p50 grows more than this: requests queue


def _candidates(runs: list[Run], metric: str) -> dict[tuple[str, float], list[tuple[Run, float]]]:
    by_x: dict[tuple[str, float], list[tuple[Run, float]]] = {}
    for run in runs:
        for lv in run.merged_levels():
            x, v = lv.x, lv.number(metric)
            if x is not None and v is not None and run.usable(lv):
                by_x.setdefault(x, []).append((run, v))
    return by_x


def _verdict(run_a: Run, run_b: Run, x: tuple[str, float], metric: str) -> Optional["noise.Verdict"]:
    """Whether two runs differ measurably at one level (kvexp/analysis/noise.py)."""
    la, lb = run_a.level_at(x), run_b.level_at(x)
    return None if la is None or lb is None else noise.compare(run_a, la, run_b, lb, metric)


def best_per_level(scenario: str, runs: list[Run]) -> list[Finding]:
    """At each concurrency (or rate) with two or more runs: the highest throughput, the lowest TTFT p95."""
    out: list[Finding] = []
    for metric, kind, better, unit, what in (
        ("throughput_tok_s", "best_throughput", max, "tok/s", "the highest throughput"),
        ("ttft_p95_ms", "best_ttft_p95", min, "ms", "the lowest TTFT p95"),
    ):
        for (xk, x), cands in sorted(_candidates(runs, metric).items()):
            if len(cands) < 2:
                continue
            ranked = sorted(cands, key=lambda rv: rv[1], reverse=better is max)
            (best, bv), (nxt, nv) = ranked[0], ranked[1]
            diff = _pct_change(bv, nv)
            diff_txt = f" ({_signed(diff)})" if diff is not None else ""
            v = _verdict(best, nxt, (xk, x), metric)
            numbers = {xk: x, metric: bv, "next": nv, "diff_pct": diff, "candidates": len(cands),
                       **(v.numbers() if v else {})}
            if v is not None and not v.measurable:
                sentence = (f"{scenario}, {x_words(xk)} {fmt_x(xk, x)}: {best.label} ({best.kind}) "
                            f"and {nxt.label} ({nxt.kind}) "
                            f"{'cannot be told apart' if v.dispersed else 'show no measurable difference'} in "
                            f"{what.split(' ', 2)[-1]}: {format_value(metric, bv)} vs {format_value(metric, nv)} "
                            f"{unit}{setup_difference(best, nxt)} ({v.reason}).")
            else:
                sentence = (f"{scenario}, {x_words(xk)} {fmt_x(xk, x)}: {best.label} ({best.kind}) has "
                            f"{what}, {format_value(metric, bv)} {unit}; next is {nxt.label} ({nxt.kind}), "
                            f"{format_value(metric, nv)} {unit}{diff_txt}{setup_difference(best, nxt)}"
                            + (f", {v.phrase}." if v else "."))
            out.append(Finding(kind, sentence, scenario, (best.label, nxt.label), numbers))
    return out


def _runner_up_peak(runs: list[Run], winner: Run) -> Optional[tuple[Run, Level, float]]:
    """The highest-throughput level of any other run: (run, level, throughput)."""
    best: Optional[tuple[Run, Level, float]] = None
    for run in runs:
        if run is winner:
            continue
        for lv in run.merged_levels():
            v = lv.number("throughput_tok_s")
            if v is not None and run.usable(lv) and lv.x and (best is None or v > best[2]):
                best = (run, lv, v)
    return best


def best_overall(scenario: str, runs: list[Run]) -> list[Finding]:
    """The highest throughput anywhere in the scenario; the run with the lowest TTFT p95 at most levels."""
    out: list[Finding] = []
    peak: Optional[tuple[Run, Level, float]] = None
    for run in runs:
        for lv in run.merged_levels():
            v = lv.number("throughput_tok_s")
            if v is not None and run.usable(lv) and lv.x and (peak is None or v > peak[2]):
                peak = (run, lv, v)
    if peak is not None and len(runs) > 1:
        run, lv, v = peak
        xk, x = lv.x  # type: ignore[misc]
        tail, numbers = "", {"throughput_tok_s": v, xk: x}
        lead = "the highest throughput overall is"
        second = _runner_up_peak(runs, run)
        if second is not None:
            r2, lv2, v2 = second
            vd = noise.compare(run, lv, r2, lv2, "throughput_tok_s")
            if vd is not None:
                numbers.update(vd.numbers(), runner_up=r2.label, runner_up_tok_s=v2)
                x2k, x2 = lv2.x  # type: ignore[misc]
                other = (f"{r2.label} ({r2.kind}), {format_value('throughput_tok_s', v2)} "
                         f"tok/s at {x_words(x2k)} {fmt_x(x2k, x2)}{setup_difference(run, r2)}")
                if vd.measurable:
                    tail = f"; the runner-up, {other}, shows {vd.phrase}"
                elif vd.dispersed:  # the verdict's words: no tie, no winner, and what to run
                    lead, tail = "the highest throughput cannot be told apart between", \
                        f", and {other}: {noise.DISPERSED}"
                elif vd.basis == "machine load":
                    lead, tail = "the highest throughput is not comparable between", f", and {other}: {vd.reason}"
                else:
                    lead, tail = "the highest throughput is a tie between", f", and {other}: {vd.phrase}"
        out.append(Finding(
            "best_overall_throughput",
            f"{scenario}: {lead} {run.label} ({run.kind}), "
            f"{format_value('throughput_tok_s', v)} tok/s at {x_words(xk)} {fmt_x(xk, x)}{tail}.",
            scenario, (run.label,), numbers))
    by_x = _candidates(runs, "ttft_p95_ms")
    contested = {x: c for x, c in by_x.items() if len(c) >= 2}
    if contested:
        wins: dict[str, list[tuple[str, float]]] = {}
        for x, cands in sorted(contested.items()):
            best = min(cands, key=lambda rv: rv[1])[0]
            wins.setdefault(best.label, []).append(x)
        top_x = max(contested)
        winner = max(wins, key=lambda lab: (len(wins[lab]), top_x in wins[lab]))
        run = next(r for r in runs if r.label == winner)
        xs = wins[winner]
        at = ", ".join(format_value(k, v) for k, v in xs)
        out.append(Finding(
            "best_overall_ttft_p95",
            f"{scenario}: {winner} ({run.kind}) has the lowest TTFT p95 at {len(xs)} of {len(contested)} "
            f"levels ({x_words(xs[0][0])} {at}).",
            scenario, (winner,), {"wins": len(xs), "levels": len(contested), "at": [v for _, v in xs]}))
    return out


def _kv_bytes(name: str, table: dict[str, float]) -> Optional[float]:
    key = name.lower()
    return table.get(name, KV_BYTES_PER_ELEMENT.get(_KV_ALIASES.get(key, key)))


def _noise_tail(xk: str, pairs: list[tuple]) -> str:
    """"; measurable at ..., no measurable difference at ... (basis)" for per-level comparisons."""
    verdicts = [(x, vd) for x, *_, vd in pairs if vd is not None]
    if not verdicts:
        return ""
    yes = [format_value(xk, x[1]) for x, vd in verdicts if vd.measurable]
    no = [format_value(xk, x[1]) for x, vd in verdicts if not vd.measurable]
    bases = {vd.basis for _, vd in verdicts}
    load = next((vd.conditions for _, vd in verdicts if vd.basis == "machine load"), None)
    if load is not None:
        return f"; not comparable: the machine's load differed between the runs ({load})"
    effect = f"a minimum effect of {noise.MIN_EFFECT * 100:.0f} % and the levels' dispersion"
    basis = ("the repeats' 95 % CIs" if bases == {"repeats"} else effect if bases == {"minimum effect"} else
             "the repeats' 95 % CIs where repeated, else a minimum effect and the levels' dispersion")
    parts = ([f"a measurable difference at {x_words(xk)} {', '.join(yes)}"] if yes else []) + (
        [f"no measurable difference at {x_words(xk)} {', '.join(no)}"] if no else [])
    return f"; {' and '.join(parts)} (against {basis})"


def kv_gains(scenario: str, runs: list[Run], kv_bytes: Optional[dict[str, float]] = None) -> list[Finding]:
    """The throughput change of a smaller KV dtype over a larger one, same backend and model, per level."""
    table = {str(k): float(v) for k, v in (kv_bytes or {}).items() if is_num(v)}
    groups: dict[tuple[str, str], dict[str, Run]] = {}
    for run in runs:
        kv = run.kv.name
        if kv is None or run.state == "failed":
            continue
        groups.setdefault((str(run.backend), str(run.model)), {}).setdefault(kv, run)
    out: list[Finding] = []
    for (backend, _model), by_kv in groups.items():
        names = list(by_kv)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                ba, bb = _kv_bytes(a, table), _kv_bytes(b, table)
                # The smaller dtype is the one whose gain is reported; unknown sizes keep input order.
                new, base = (b, a) if ba is not None and bb is not None and bb < ba else (a, b)
                rn, rb = by_kv[new], by_kv[base]
                tb = {lv.x: lv.number("throughput_tok_s") for lv in rb.merged_levels() if rb.usable(lv)}
                pairs = []
                for lv in rn.merged_levels():
                    x, v = lv.x, lv.number("throughput_tok_s")
                    old = tb.get(x)
                    if x is not None and v is not None and old and rn.usable(lv):
                        pairs.append((x, v, old, _pct_change(v, old), _verdict(rn, rb, x, "throughput_tok_s")))
                if not pairs:
                    continue
                xk = pairs[0][0][0]
                gains = ", ".join(_signed(g) for *_, g, _v in pairs)
                xs = ", ".join(format_value(xk, x[1]) for x, *_ in pairs)
                out.append(Finding(
                    "kv_gain",
                    f"{backend_name(backend)}, {scenario}: {new} KV changes throughput by {gains} over {base} KV "
                    f"at {x_words(xk)} {xs} ({rn.label} vs {rb.label}){_noise_tail(xk, pairs)}.",
                    scenario, (rn.label, rb.label),
                    {"kv": new, "baseline_kv": base, "backend": backend,
                     "levels": [{xk: x[1], "throughput_tok_s": v, "baseline_tok_s": o, "gain_pct": g,
                                 **(vd.numbers() if vd else {})} for x, v, o, g, vd in pairs]}))
    return out


def saturation(scenario: str, run: Run) -> Optional[Finding]:
    """Where throughput stops growing while TTFT keeps rising (requests queue instead of being served)."""
    pts = [(lv.x, lv.number("throughput_tok_s"), lv.number("ttft_p50_ms")) for lv in run.merged_levels()
           if run.usable(lv)]
    pts = [(x, t, f) for x, t, f in pts if x is not None and t is not None]
    if len(pts) < 2 or len({x[0] for x, _, _ in pts}) != 1:
        return None
    xk = pts[0][0][0]
    label, who = run.label, f"{run.label} ({run.kind}, {scenario})"
    tputs = [t for _, t, _ in pts]
    chain = " → ".join(format_value("throughput_tok_s", t) for t in tputs)
    xs = " → ".join(format_value(xk, x[1]) for x, _, _ in pts)
    if max(tputs[1:]) < tputs[0] * (1 + SATURATION_TPUT_GROWTH):
        f0, f1 = pts[0][2], pts[-1][2]
        queue = ""
        if f0 is not None and f1 is not None and f1 > f0 * (1 + SATURATION_TTFT_GROWTH):
            queue = (f" while TTFT p50 rises from {format_value('ttft_p50_ms', f0)} to "
                     f"{format_value('ttft_p50_ms', f1)} ms: requests queue")
        name, kv = run.backend_name, run.kv.name
        return Finding(
            "no_growth",
            f"{name}'s throughput does not grow with {x_words(xk)} in the {scenario} scenario ({chain} tok/s at "
            f"{x_words(xk)} {xs}; {label}{f', {kv} KV' if kv else ''}){queue}.",
            scenario, (label,), {"throughput_tok_s": tputs, xk: [x[1] for x, _, _ in pts],
                                 "ttft_p50_ms": [f for _, _, f in pts]})
    for (x0, t0, f0), (x1, t1, f1) in zip(pts, pts[1:]):
        if f0 is None or f1 is None or not t0 or not f0:
            continue
        gt, gf = (t1 - t0) / t0, (f1 - f0) / f0
        if gt < SATURATION_TPUT_GROWTH and gf > SATURATION_TTFT_GROWTH:
            return Finding(
                "saturation",
                f"{who}: throughput stops growing beyond {x_words(xk)} {fmt_x(xk, x0[1])} "
                f"({format_value('throughput_tok_s', t0)} → {format_value('throughput_tok_s', t1)} tok/s, "
                f"{_signed(gt * 100)}) while TTFT p50 rises {_signed(gf * 100)} "
                f"({format_value('ttft_p50_ms', f0)} → {format_value('ttft_p50_ms', f1)} ms): requests queue.",
                scenario, (label,), {xk: [x0[1], x1[1]], "throughput_tok_s": [t0, t1], "ttft_p50_ms": [f0, f1],
                                     "throughput_growth_pct": gt * 100, "ttft_growth_pct": gf * 100})
    return None


def preemption_onset(scenario: str, run: Run, plan: Optional["RunPlan"] = None) -> Optional[Finding]:
    """The first level with preemptions, or that none happened, for runs whose backend exposes them."""
    if not run.exposes("preemptions"):
        return None
    levels = [lv for lv in run.merged_levels() if run.usable(lv) and lv.x]
    if not levels:
        return None
    label, who = run.label, f"{run.label} ({run.kind}, {scenario})"
    predicted = ""
    if plan is not None and plan.max_concurrency is not None:
        room = format_value("concurrency", plan.max_concurrency)
        predicted = f"; the planner ({plan.source}) predicts room for {room} concurrent requests"
    for lv in levels:
        p = lv.number("preemptions")
        if p:
            xk, x = lv.x  # type: ignore[misc]
            kv = lv.number("peak_kv_cache_usage")
            kv_txt = f", peak KV usage {format_value('peak_kv_cache_usage', kv)} %" if kv is not None else ""
            return Finding(
                "preemption",
                f"{who}: preemptions begin at {x_words(xk)} {fmt_x(xk, x)} ({format_value('preemptions', p)} "
                f"preemptions{kv_txt}){predicted}.",
                scenario, (label,), {xk: x, "preemptions": p, "peak_kv_cache_usage": kv,
                                     "predicted_max_concurrency": plan.max_concurrency if plan else None})
    xk, x = levels[-1].x  # type: ignore[misc]
    kvs = [v for v in (lv.number("peak_kv_cache_usage") for lv in levels) if v is not None]
    kv_txt = f" (peak KV usage {format_value('peak_kv_cache_usage', max(kvs))} %)" if kvs else ""
    return Finding(
        "no_preemption", f"{who}: no preemptions up to {x_words(xk)} {fmt_x(xk, x)}{kv_txt}{predicted}.",
        scenario, (label,), {xk: x, "peak_kv_cache_usage": max(kvs) if kvs else None})


def not_exposed(runs: Iterable[Run]) -> Optional[Finding]:
    # Runs from another tool's file say what that tool does not record in their own section.
    hidden = [r for r in runs if r.levels and not r.exposes("peak_kv_cache_usage") and not r.tool]
    if not hidden:
        return None
    backends = sorted({r.backend_name for r in hidden})
    return Finding(
        "not_exposed",
        f"KV-cache usage is not exposed by {', '.join(backends)} ({len(hidden)} run{'s' if len(hidden) != 1 else ''}); "
        "those cells read \"not exposed\", not 0.",
        None, tuple(r.label for r in hidden), {"backends": backends})


def kv_unconfirmed(run: Run) -> Optional[Finding]:
    """A kvexp run whose server did not state the KV dtype it applied: its figures are the asked one's
    only as far as the server honoured it."""
    asked = run.kv_requested
    if run.tool or not asked or run.kv_cache.dtype or not run.levels:
        return None
    return Finding(
        "kv_unconfirmed",
        f"{run.label} ({run.backend_name}): the server did not confirm its KV dtype (asked: "
        f"{asked}); its figures are what was asked, not what is known to have run.",
        str(run.scenario), (run.label,), {"kv_requested": asked})


def variable_length(run: Run) -> Optional[Finding]:
    flag = run.variable_length
    assumed = flag is None and run.caps_output_only
    if not (flag is True or assumed):
        return None
    outs = [v for v in (lv.number("mean_output_tokens") for lv in run.levels) if v is not None]
    cap = run.max_tokens
    detail = ""
    if outs:
        detail = f"; mean output {format_value('mean_output_tokens', min(outs))}–" \
                 f"{format_value('mean_output_tokens', max(outs))} tokens"
    why = " (assumed from the backend: the run does not record variable_length)" if assumed else ""
    cap_txt = f" (capped at {cap} tokens{detail})" if cap is not None else ""
    return Finding(
        "variable_length",
        f"{run.label} ({run.backend_name}): output length was not forced{cap_txt}, so its "
        f"throughput and TPOT are not strictly comparable with forced-length runs{why}.",
        str(run.scenario), (run.label,), {"max_tokens": cap, "assumed": assumed})


def failures(run: Run) -> list[Finding]:
    out: list[Finding] = []
    status, label = run.state, run.label
    if status in ("failed", "partial", "skipped"):
        reason = first_line(run.status_reason)
        verb = {"failed": "failed", "partial": "is partial", "skipped": "was skipped"}[status]
        out.append(Finding(
            status, f"{label} ({run.kind}, {run.scenario}) {verb}" + (f": {reason}" if reason else "."),
            str(run.scenario), (label,), {"status": status}))
    for lv in run.levels:
        if lv.failed and lv.x:
            xk, x = lv.x  # type: ignore[misc]
            reason = first_line(lv.status_reason)
            out.append(Finding(
                "failed_level", f"{label}: the level at {x_words(xk)} {fmt_x(xk, x)} failed"
                + (f": {reason}" if reason else "."), str(run.scenario), (label,), {xk: x}))
    return out


def compute_findings(aggregate: Aggregate) -> list[Finding]:
    """Every finding, in report order: failures, best per scenario, KV dtypes, saturation, preemption, caveats."""
    kv_bytes = (aggregate.planner.kv_bytes if aggregate.planner is not None else None) or {}
    out: list[Finding] = []
    runs = aggregate.runs
    for run in runs:
        out += failures(run)
    groups = aggregate.scenarios()
    # runs set against each other only within a field of comparable runs (comparable.partition): a partial,
    # copied or unconfirmed run, other weights or other machine load are never "the best"
    fields = [(scen, list(f.runs)) for scen, srun in groups for f in partition(srun)[0]]
    for scen, srun in fields:
        out += best_overall(scen, srun)
    for scen, srun in fields:
        out += kv_gains(scen, srun, kv_bytes)
    out += quality_findings(aggregate)
    out += card_findings(aggregate.kv_cards if isinstance(aggregate.kv_cards, list) else kv_cards(aggregate))
    for scen, srun in groups:
        out += [f for f in (saturation(scen, r) for r in srun) if f]
    for scen, srun in groups:
        out += [f for f in (preemption_onset(scen, r, run_plan(r, aggregate)) for r in srun) if f]
    out += [f for f in (kv_unconfirmed(r) for r in runs) if f]
    out += [f for f in (variable_length(r) for r in runs) if f]
    ne = not_exposed(runs)
    if ne:
        out.append(ne)
    for scen, srun in fields:
        out += best_per_level(scen, srun)
    return out
