"""What a comparison shows, computed from an aggregate: pure functions that return small dataclasses.

Nothing here prints, plots or reads files. Each `Finding` carries one sentence for the report and the
numbers behind it; each `LevelWarning` marks one level whose numbers should not be taken as firm.
The same module holds the few accessors and number formats that the report and the charts share, so
a figure reads the same in a sentence, a table cell and a CSV row.

Missing is None throughout: a level without a value is skipped, never treated as 0."""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Optional

from kvexp import backends
from kvexp.analysis import noise
from kvexp.metrics.levels import MAX_CV, MIN_REQUESTS, SPREAD_RATIO
from kvexp.metrics.levels import WARNING_CODES as LEVEL_WARNING_CODES
from kvexp.capacity.planner import KV_BYTES_PER_ELEMENT, kv_bytes_per_token
from kvexp.metrics.registry import format_value

# Thresholds for "throughput stopped growing" (those for unstable levels live in levels.py).
SATURATION_TPUT_GROWTH = 0.10  # throughput grows less than this between two levels ...
SATURATION_TTFT_GROWTH = 0.50  # ... while TTFT p50 grows more than this: requests queue

# KV figures a backend may not expose: null means "not exposed", never 0.
EXPOSURE_KEYS = ("peak_kv_cache_usage", "preemptions", "prefix_cache.hit_rate")

# Short spellings seen in other tools' labels, beside planner.KV_BYTES_PER_ELEMENT's.
_KV_ALIASES = {"q8": "q8_0", "q4": "q4_0", "auto": "fp16"}
_LABEL_KV = re.compile(r"(?:^|[-_.])(fp32|f32|fp16|f16|bf16|fp8|q8_0|q8|q5_1|q5_0|q4_1|q4_0|q4)[-_]?kv(?:$|[-_.])",
                       re.IGNORECASE)


# ----------------------------------------------------------------------------------------------
# Accessors


def backend_name(backend: Optional[str]) -> str:
    return backends.display_name(backend)


def caps_output_only(run: dict) -> bool:
    """The run's backend can only cap output length (used when a run does not record variable_length)."""
    adapter = backends.find(run.get("backend"))
    return adapter is not None and not adapter.capabilities.forces_output_length


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def num(d: dict, key: str) -> Optional[float]:
    v = level_value(d, key)
    return float(v) if is_num(v) else None


def level_value(level: dict, key: str) -> Any:
    """A level's value by key; a dotted key reads a nested block ("server.tpot_p50_ms")."""
    head, dot, rest = key.partition(".")
    if not dot:
        return level.get(key)
    inner = level.get(head)
    return level_value(inner, rest) if isinstance(inner, dict) else None


@dataclass(frozen=True)
class KVName:
    name: Optional[str]
    source: Optional[str]  # "requested" | "server" | "label" | None
    note: Optional[str] = None  # KV numerics beside the dtype: "rotated", "not rotated", "scale 1.0"

    @property
    def display(self) -> str:
        if self.name is None:
            return "—"
        name = f"{self.name}†" if self.source == "label" else self.name
        return f"{name} ({self.note})" if self.note else name


def kv_note(run: dict, name: Optional[str]) -> Optional[str]:
    """What the server did to its KV values besides their dtype, where it changes the numbers: llama.cpp's
    rotation of a quantised cache (as its log states it), vLLM's fp8 scales (as launched)."""
    kv = run.get("kv_cache") or {}
    rotation = [kv.get("rotation_k"), kv.get("rotation_v")]
    if any(rotation):
        return "rotated" if all(rotation) else f"{'K' if rotation[0] else 'V'} rotated"
    if rotation != [None, None] and str(name or "").startswith(("q", "iq")):
        return "not rotated"
    scales = str((run.get("numerics") or {}).get("kv_scales") or "")
    return ("scales computed" if scales.startswith("computed") else "scale 1.0") if scales else None


def kv_name(run: dict) -> KVName:
    """The run's KV dtype: as requested, else as the server reported it, else read from the label; with
    its numerics note (kv_note)."""
    kv = _kv_name(run)
    return replace(kv, note=kv_note(run, kv.name)) if kv.name else kv


def _kv_name(run: dict) -> KVName:
    if run.get("kv_requested"):
        return KVName(str(run["kv_requested"]), "requested")
    kv = run.get("kv_cache") or {}
    if kv.get("dtype"):
        return KVName(str(kv["dtype"]), "server")
    if kv.get("dtype_k"):
        k, v = kv.get("dtype_k"), kv.get("dtype_v")
        return KVName(str(k) if not v or v == k else f"{k}/{v}", "server")
    m = _LABEL_KV.search(str(run.get("label") or ""))
    if m:
        return KVName(m.group(1).lower(), "label")
    return KVName(None, None)


def weights_display(run: dict) -> str:
    """The weights a run's server ran, as a table shows them: "GGUF Q4_1, 5.74 bits/weight", "bfloat16"."""
    w = run.get("weights") or {}
    fmt, bits = w.get("weights_format"), w.get("bits_per_weight")
    if fmt and bits and fmt.startswith("GGUF"):
        return f"{fmt}, {bits:.2f} bits/weight"
    return str(fmt) if fmt else "—"


def run_kind(run: dict) -> str:
    """"vLLM, fp8 KV": how sentences name a run's configuration."""
    kv = kv_name(run)
    return f"{backend_name(run.get('backend'))}, {kv.name} KV" if kv.name else backend_name(run.get("backend"))


def run_status(run: dict) -> str:
    return str(run.get("status") or "complete")


def level_x(level: dict) -> Optional[tuple[str, float]]:
    """("concurrency", c) for closed-loop levels, ("rate", r) for open-loop ones."""
    c = num(level, "concurrency")
    if c is not None:
        return ("concurrency", c)
    r = num(level, "rate")
    if r is not None:
        return ("rate", r)
    return None


def x_words(kind: str) -> str:
    return "concurrency" if kind == "concurrency" else "request rate"


def fmt_x(kind: str, x: float) -> str:
    return format_value(kind, x) + (" req/s" if kind == "rate" else "")


def _x_key(level: dict) -> tuple[str, float]:
    return level_x(level) or ("~", math.inf)


_SUM_KEYS = {"requests", "errors", "preemptions", "output_tokens"}
_MAX_KEYS = {"max_running", "max_waiting", "loop_lag_p99_ms"}


def _merge_repeats(group: list[dict]) -> dict:
    """Repeats of one level as one: sums of counts, maxima of peaks, means of everything else."""
    ok = [lv for lv in group if lv.get("status", "ok") != "failed"] or group
    if len(ok) == 1:
        return ok[0]
    out = dict(ok[0])
    for key in {k for lv in ok for k in lv}:
        vals = [float(lv[key]) for lv in ok if is_num(lv.get(key))]
        if key in ("concurrency", "rate", "repeat") or not vals:
            continue
        if key in _SUM_KEYS:
            out[key] = sum(vals)
        elif key.startswith("peak_") or key in _MAX_KEYS:
            out[key] = max(vals)
        else:
            out[key] = statistics.fmean(vals)
    out["errors"] = int(out["errors"]) if is_num(out.get("errors")) else out.get("errors")
    out["repeat_throughputs"] = [float(lv["throughput_tok_s"]) for lv in ok if is_num(lv.get("throughput_tok_s"))]
    return out


def sorted_levels(run: dict) -> list[dict]:
    """The run's levels by concurrency (or rate); repeats of one level merged into one (see _merge_repeats).
    Findings and charts read these; tables show the levels as recorded."""
    groups: dict[tuple[str, float], list[dict]] = {}
    loose: list[dict] = []
    for lv in run.get("levels") or []:
        if isinstance(lv, dict):
            x = level_x(lv)
            (groups.setdefault(x, []) if x else loose).append(lv)
    return sorted([_merge_repeats(g) for g in groups.values()] + loose, key=_x_key)


def usable(run: dict, level: dict) -> bool:
    return run_status(run) not in ("failed", "skipped") and level.get("status", "ok") != "failed"


def exposes(run: dict, key: str) -> bool:
    """Whether any level of the run carries `key` (KV usage and preemptions are often not exposed)."""
    return any(is_num(level_value(lv, key)) for lv in run.get("levels") or [])


def scenarios(aggregate: dict) -> list[tuple[str, list[dict]]]:
    """Runs grouped by scenario name, in order of first appearance."""
    groups: dict[str, list[dict]] = {}
    for run in aggregate.get("runs") or []:
        groups.setdefault(str(run.get("scenario") or "unnamed"), []).append(run)
    return list(groups.items())


def _pct_change(new: float, old: float) -> Optional[float]:
    return (new - old) / old * 100 if old else None


def _signed(p: float) -> str:
    return f"{p:+.1f} %"


# ----------------------------------------------------------------------------------------------
# Findings


@dataclass(frozen=True)
class Finding:
    kind: str  # best_throughput | best_ttft_p95 | best_overall_throughput | best_overall_ttft_p95 | kv_gain
    #           | no_growth | saturation | preemption | no_preemption | not_exposed | variable_length
    #           | failed | partial | failed_level
    sentence: str
    scenario: Optional[str] = None
    runs: tuple[str, ...] = ()
    numbers: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LevelWarning:
    kind: str  # errors | few_requests | spread | cv | client_limited | failed | reported
    code: str  # a short tag for table cells
    run_index: int
    level_index: int  # index into run["levels"] as given
    label: str
    scenario: str
    message: str


def _candidates(runs: list[dict], metric: str) -> dict[tuple[str, float], list[tuple[dict, float]]]:
    by_x: dict[tuple[str, float], list[tuple[dict, float]]] = {}
    for run in runs:
        for lv in sorted_levels(run):
            x, v = level_x(lv), num(lv, metric)
            if x is not None and v is not None and usable(run, lv):
                by_x.setdefault(x, []).append((run, v))
    return by_x


def _level_at(run: dict, x: tuple[str, float]) -> Optional[dict]:
    return next((lv for lv in sorted_levels(run) if level_x(lv) == x), None)


def _verdict(run_a: dict, run_b: dict, x: tuple[str, float], metric: str) -> Optional["noise.Verdict"]:
    """Whether two runs differ measurably at one level (kvexp/analysis/noise.py)."""
    la, lb = _level_at(run_a, x), _level_at(run_b, x)
    return None if la is None or lb is None else noise.compare(run_a, la, run_b, lb, metric)


def best_per_level(scenario: str, runs: list[dict]) -> list[Finding]:
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
                sentence = (f"{scenario}, {x_words(xk)} {fmt_x(xk, x)}: {best.get('label')} ({run_kind(best)}) "
                            f"and {nxt.get('label')} ({run_kind(nxt)}) show no measurable difference in "
                            f"{what.split(' ', 2)[-1]}: {format_value(metric, bv)} vs {format_value(metric, nv)} "
                            f"{unit} ({v.reason}).")
            else:
                sentence = (f"{scenario}, {x_words(xk)} {fmt_x(xk, x)}: {best.get('label')} ({run_kind(best)}) has "
                            f"{what}, {format_value(metric, bv)} {unit}; next is {nxt.get('label')} ({run_kind(nxt)}), "
                            f"{format_value(metric, nv)} {unit}{diff_txt}" + (f", {v.phrase}." if v else "."))
            out.append(Finding(kind, sentence, scenario, (str(best.get("label")), str(nxt.get("label"))), numbers))
    return out


def _runner_up_peak(runs: list[dict], winner: dict) -> Optional[tuple[dict, dict, float]]:
    """The highest-throughput level of any other run: (run, level, throughput)."""
    best: Optional[tuple[dict, dict, float]] = None
    for run in runs:
        if run is winner:
            continue
        for lv in sorted_levels(run):
            v = num(lv, "throughput_tok_s")
            if v is not None and usable(run, lv) and level_x(lv) and (best is None or v > best[2]):
                best = (run, lv, v)
    return best


def best_overall(scenario: str, runs: list[dict]) -> list[Finding]:
    """The highest throughput anywhere in the scenario; the run with the lowest TTFT p95 at most levels."""
    out: list[Finding] = []
    peak: Optional[tuple[dict, dict, float]] = None
    for run in runs:
        for lv in sorted_levels(run):
            v = num(lv, "throughput_tok_s")
            if v is not None and usable(run, lv) and level_x(lv) and (peak is None or v > peak[2]):
                peak = (run, lv, v)
    if peak is not None and len(runs) > 1:
        run, lv, v = peak
        xk, x = level_x(lv)  # type: ignore[misc]
        tail, numbers = "", {"throughput_tok_s": v, xk: x}
        second = _runner_up_peak(runs, run)
        if second is not None:
            r2, lv2, v2 = second
            vd = noise.compare(run, lv, r2, lv2, "throughput_tok_s")
            if vd is not None:
                numbers.update(vd.numbers(), runner_up=str(r2.get("label")), runner_up_tok_s=v2)
                x2k, x2 = level_x(lv2)  # type: ignore[misc]
                tail = (f"; the runner-up, {r2.get('label')} ({run_kind(r2)}), {format_value('throughput_tok_s', v2)} "
                        f"tok/s at {x_words(x2k)} {fmt_x(x2k, x2)}, shows {vd.phrase}")
        out.append(Finding(
            "best_overall_throughput",
            f"{scenario}: the highest throughput overall is {run.get('label')} ({run_kind(run)}), "
            f"{format_value('throughput_tok_s', v)} tok/s at {x_words(xk)} {fmt_x(xk, x)}{tail}.",
            scenario, (str(run.get("label")),), numbers))
    by_x = _candidates(runs, "ttft_p95_ms")
    contested = {x: c for x, c in by_x.items() if len(c) >= 2}
    if contested:
        wins: dict[str, list[tuple[str, float]]] = {}
        for x, cands in sorted(contested.items()):
            best = min(cands, key=lambda rv: rv[1])[0]
            wins.setdefault(str(best.get("label")), []).append(x)
        top_x = max(contested)
        winner = max(wins, key=lambda lab: (len(wins[lab]), top_x in wins[lab]))
        run = next(r for r in runs if str(r.get("label")) == winner)
        xs = wins[winner]
        at = ", ".join(format_value(k, v) for k, v in xs)
        out.append(Finding(
            "best_overall_ttft_p95",
            f"{scenario}: {winner} ({run_kind(run)}) has the lowest TTFT p95 at {len(xs)} of {len(contested)} "
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
    basis = ("the repeats' 95 % CIs" if bases == {"repeats"} else
             f"a minimum effect of {noise.MIN_EFFECT * 100:.0f} % and the levels' dispersion" if bases == {"minimum effect"}
             else "the repeats' 95 % CIs where repeated, else a minimum effect and the levels' dispersion")
    parts = ([f"a measurable difference at {x_words(xk)} {', '.join(yes)}"] if yes else []) + (
        [f"no measurable difference at {x_words(xk)} {', '.join(no)}"] if no else [])
    return f"; {' and '.join(parts)} (against {basis})"


def kv_gains(scenario: str, runs: list[dict], kv_bytes: Optional[dict[str, float]] = None) -> list[Finding]:
    """The throughput change of a smaller KV dtype over a larger one, same backend and model, per level."""
    table = {str(k): float(v) for k, v in (kv_bytes or {}).items() if is_num(v)}
    groups: dict[tuple[str, str], dict[str, dict]] = {}
    for run in runs:
        kv = kv_name(run).name
        if kv is None or run_status(run) == "failed":
            continue
        groups.setdefault((str(run.get("backend")), str(run.get("model"))), {}).setdefault(kv, run)
    out: list[Finding] = []
    for (backend, _model), by_kv in groups.items():
        names = list(by_kv)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                ba, bb = _kv_bytes(a, table), _kv_bytes(b, table)
                # The smaller dtype is the one whose gain is reported; unknown sizes keep input order.
                new, base = (b, a) if ba is not None and bb is not None and bb < ba else (a, b)
                rn, rb = by_kv[new], by_kv[base]
                tb = {level_x(lv): num(lv, "throughput_tok_s") for lv in sorted_levels(rb) if usable(rb, lv)}
                pairs = []
                for lv in sorted_levels(rn):
                    x, v = level_x(lv), num(lv, "throughput_tok_s")
                    old = tb.get(x)
                    if x is not None and v is not None and old and usable(rn, lv):
                        pairs.append((x, v, old, _pct_change(v, old), _verdict(rn, rb, x, "throughput_tok_s")))
                if not pairs:
                    continue
                xk = pairs[0][0][0]
                gains = ", ".join(_signed(g) for *_, g, _v in pairs)
                xs = ", ".join(format_value(xk, x[1]) for x, *_ in pairs)
                out.append(Finding(
                    "kv_gain",
                    f"{backend_name(backend)}, {scenario}: {new} KV changes throughput by {gains} over {base} KV "
                    f"at {x_words(xk)} {xs} ({rn.get('label')} vs {rb.get('label')}){_noise_tail(xk, pairs)}.",
                    scenario, (str(rn.get("label")), str(rb.get("label"))),
                    {"kv": new, "baseline_kv": base, "backend": backend,
                     "levels": [{xk: x[1], "throughput_tok_s": v, "baseline_tok_s": o, "gain_pct": g,
                                 **(vd.numbers() if vd else {})} for x, v, o, g, vd in pairs]}))
    return out


def saturation(scenario: str, run: dict) -> Optional[Finding]:
    """Where throughput stops growing while TTFT keeps rising (requests queue instead of being served)."""
    pts = [(level_x(lv), num(lv, "throughput_tok_s"), num(lv, "ttft_p50_ms")) for lv in sorted_levels(run)
           if usable(run, lv)]
    pts = [(x, t, f) for x, t, f in pts if x is not None and t is not None]
    if len(pts) < 2 or len({x[0] for x, _, _ in pts}) != 1:
        return None
    xk = pts[0][0][0]
    label, who = str(run.get("label")), f"{run.get('label')} ({run_kind(run)}, {scenario})"
    tputs = [t for _, t, _ in pts]
    chain = " → ".join(format_value("throughput_tok_s", t) for t in tputs)
    xs = " → ".join(format_value(xk, x[1]) for x, _, _ in pts)
    if max(tputs[1:]) < tputs[0] * (1 + SATURATION_TPUT_GROWTH):
        f0, f1 = pts[0][2], pts[-1][2]
        queue = ""
        if f0 is not None and f1 is not None and f1 > f0 * (1 + SATURATION_TTFT_GROWTH):
            queue = (f" while TTFT p50 rises from {format_value('ttft_p50_ms', f0)} to "
                     f"{format_value('ttft_p50_ms', f1)} ms: requests queue")
        name, kv = backend_name(run.get("backend")), kv_name(run).name
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


def preemption_onset(scenario: str, run: dict, plan: Optional["RunPlan"] = None) -> Optional[Finding]:
    """The first level with preemptions, or that none happened, for runs whose backend exposes them."""
    if not exposes(run, "preemptions"):
        return None
    levels = [lv for lv in sorted_levels(run) if usable(run, lv) and level_x(lv)]
    if not levels:
        return None
    label, who = str(run.get("label")), f"{run.get('label')} ({run_kind(run)}, {scenario})"
    predicted = ""
    if plan is not None and plan.max_concurrency is not None:
        room = format_value("concurrency", plan.max_concurrency)
        predicted = f"; the planner ({plan.source}) predicts room for {room} concurrent requests"
    for lv in levels:
        p = num(lv, "preemptions")
        if p:
            xk, x = level_x(lv)  # type: ignore[misc]
            kv = num(lv, "peak_kv_cache_usage")
            kv_txt = f", peak KV usage {format_value('peak_kv_cache_usage', kv)} %" if kv is not None else ""
            return Finding(
                "preemption",
                f"{who}: preemptions begin at {x_words(xk)} {fmt_x(xk, x)} ({format_value('preemptions', p)} "
                f"preemptions{kv_txt}){predicted}.",
                scenario, (label,), {xk: x, "preemptions": p, "peak_kv_cache_usage": kv,
                                     "predicted_max_concurrency": plan.max_concurrency if plan else None})
    xk, x = level_x(levels[-1])  # type: ignore[misc]
    kvs = [v for v in (num(lv, "peak_kv_cache_usage") for lv in levels) if v is not None]
    kv_txt = f" (peak KV usage {format_value('peak_kv_cache_usage', max(kvs))} %)" if kvs else ""
    return Finding(
        "no_preemption", f"{who}: no preemptions up to {x_words(xk)} {fmt_x(xk, x)}{kv_txt}{predicted}.",
        scenario, (label,), {xk: x, "peak_kv_cache_usage": max(kvs) if kvs else None})


def not_exposed(runs: Iterable[dict]) -> Optional[Finding]:
    # Runs from another tool's file say what that tool does not record in their own section.
    hidden = [r for r in runs if r.get("levels") and not exposes(r, "peak_kv_cache_usage") and not r.get("tool")]
    if not hidden:
        return None
    backends = sorted({backend_name(r.get("backend")) for r in hidden})
    return Finding(
        "not_exposed",
        f"KV-cache usage is not exposed by {', '.join(backends)} ({len(hidden)} run{'s' if len(hidden) != 1 else ''}); "
        "those cells read \"not exposed\", not 0.",
        None, tuple(str(r.get("label")) for r in hidden), {"backends": backends})


def variable_length(run: dict) -> Optional[Finding]:
    flag = run.get("variable_length")
    assumed = flag is None and caps_output_only(run)
    if not (flag is True or assumed):
        return None
    outs = [v for v in (num(lv, "mean_output_tokens") for lv in run.get("levels") or []) if v is not None]
    cap = run.get("max_tokens")
    detail = ""
    if outs:
        detail = f"; mean output {format_value('mean_output_tokens', min(outs))}–" \
                 f"{format_value('mean_output_tokens', max(outs))} tokens"
    why = " (assumed from the backend: the run does not record variable_length)" if assumed else ""
    cap_txt = f" (capped at {cap} tokens{detail})" if cap is not None else ""
    return Finding(
        "variable_length",
        f"{run.get('label')} ({backend_name(run.get('backend'))}): output length was not forced{cap_txt}, so its "
        f"throughput and TPOT are not strictly comparable with forced-length runs{why}.",
        str(run.get("scenario")), (str(run.get("label")),), {"max_tokens": cap, "assumed": assumed})


def first_line(text: Any, limit: int = 200) -> str:
    lines = [ln.strip() for ln in str(text or "").splitlines() if ln.strip()]
    if not lines:
        return ""
    line = lines[-1] if len(lines) > 1 else lines[0]  # a log tail ends with the cause
    return line if len(line) <= limit else line[: limit - 1] + "…"


def failures(run: dict) -> list[Finding]:
    out: list[Finding] = []
    status, label = run_status(run), str(run.get("label"))
    if status in ("failed", "partial", "skipped"):
        reason = first_line(run.get("status_reason"))
        verb = {"failed": "failed", "partial": "is partial", "skipped": "was skipped"}[status]
        out.append(Finding(
            status, f"{label} ({run_kind(run)}, {run.get('scenario')}) {verb}" + (f": {reason}" if reason else "."),
            str(run.get("scenario")), (label,), {"status": status}))
    for lv in run.get("levels") or []:
        if lv.get("status") == "failed" and level_x(lv):
            xk, x = level_x(lv)  # type: ignore[misc]
            reason = first_line(lv.get("status_reason"))
            out.append(Finding(
                "failed_level", f"{label}: the level at {x_words(xk)} {fmt_x(xk, x)} failed"
                + (f": {reason}" if reason else "."), str(run.get("scenario")), (label,), {xk: x}))
    return out


def compute_findings(aggregate: dict) -> list[Finding]:
    """Every finding, in report order: failures, best per scenario, KV dtypes, saturation, preemption, caveats."""
    kv_bytes = (aggregate.get("planner") or {}).get("kv_bytes") or {}
    out: list[Finding] = []
    runs = list(aggregate.get("runs") or [])
    for run in runs:
        out += failures(run)
    groups = scenarios(aggregate)
    for scen, srun in groups:
        out += best_overall(scen, srun)
    for scen, srun in groups:
        out += kv_gains(scen, srun, kv_bytes)
    from kvexp.analysis.qualityfindings import quality_findings  # capacity and speed against quality cost

    out += quality_findings(aggregate)
    for scen, srun in groups:
        out += [f for f in (saturation(scen, r) for r in srun) if f]
    for scen, srun in groups:
        out += [f for f in (preemption_onset(scen, r, run_plan(r, aggregate)) for r in srun) if f]
    out += [f for f in (variable_length(r) for r in runs) if f]
    ne = not_exposed(runs)
    if ne:
        out.append(ne)
    for scen, srun in groups:
        out += best_per_level(scen, srun)
    return out


# ----------------------------------------------------------------------------------------------
# Stability warnings


def repeat_stats(level: dict) -> dict[str, Optional[float]]:
    """n, cv (a fraction) and ci95 of throughput over repeats, from whatever the level carries:
    a `repeats` summary object ({n, cv, ci95, mean} or {"throughput_tok_s": {...}}), a list of repeat
    throughputs, a count, top-level `cv` / `throughput_ci95`, or repeats merged by sorted_levels."""
    out: dict[str, Any] = {"n": None, "cv": None, "ci95": None}
    r = level.get("repeats")
    if isinstance(r, dict):
        src = r.get("throughput_tok_s") if isinstance(r.get("throughput_tok_s"), dict) else r
        out.update(n=src.get("n", r.get("n")), cv=src.get("cv"), ci95=src.get("ci95", r.get("throughput_ci95")))
    elif isinstance(r, list):
        vals = [num(x, "throughput_tok_s") if isinstance(x, dict) else (float(x) if is_num(x) else None) for x in r]
        out["n"] = len(r)
        level = {**level, "repeat_throughputs": [v for v in vals if v is not None]}
    elif is_num(r):
        out["n"] = r
    vals = level.get("repeat_throughputs")
    if isinstance(vals, list) and len(vals) >= 2 and out["cv"] is None:
        m = statistics.fmean(vals)
        out["n"] = out["n"] or len(vals)
        out["cv"] = statistics.stdev(vals) / m if m else None
    cv = level.get("cv")
    if isinstance(cv, dict):
        cv = cv.get("throughput_tok_s")
    if is_num(cv):
        out["cv"] = float(cv)
    if level.get("throughput_ci95") is not None:
        out["ci95"] = level["throughput_ci95"]
    return out


# A run's own warning codes (levels.py) -> (kind, table tag) of the checks below; other codes are shown
# as recorded. Plain-text warnings (schema_version 1) are shown as recorded.
_REPORTED = {"errors": ("errors", "errors"), "few_requests": ("few_requests", f"n<{MIN_REQUESTS}"),
             "ttft_spread": ("spread", "spread"), "client_limited": ("client_limited", "client"),
             "unstable": ("cv", "cv")}


def level_warnings(aggregate: dict) -> list[LevelWarning]:
    """Levels whose numbers should not be read as firm: a failed level, errors, few requests, a wide TTFT
    spread, noisy repeats, a client that could not keep up. A level that carries its own `warnings`
    list (kvexp's runner makes the same checks) is shown with those texts instead of recomputed ones."""
    out: list[LevelWarning] = []
    for ri, run in enumerate(aggregate.get("runs") or []):
        label, scen = str(run.get("label")), str(run.get("scenario") or "unnamed")
        first_of: dict[tuple[str, float], int] = {}
        repeats: dict[tuple[str, float], list[float]] = {}
        for li, lv in enumerate(run.get("levels") or []):
            x = level_x(lv)
            where = f"{label} at {x_words(x[0])} {fmt_x(*x)}" if x else f"{label} level {li + 1}"
            if x and (lv.get("repeat") or 0) > 0:
                where += f" (repeat {lv['repeat']})"

            def add(kind: str, code: str, msg: str) -> None:
                out.append(LevelWarning(kind, code, ri, li, label, scen, f"{where}: {msg}"))

            if x is not None:
                first_of.setdefault(x, li)
                if is_num(lv.get("throughput_tok_s")) and lv.get("status", "ok") != "failed":
                    repeats.setdefault(x, []).append(float(lv["throughput_tok_s"]))
            if lv.get("status") == "failed":
                reason = first_line(lv.get("status_reason"))
                add("failed", "failed", "the level failed" + (f": {reason}" if reason else "."))
            reported = lv.get("warnings")
            if isinstance(reported, list):
                for w in reported:
                    code = w.get("code") if isinstance(w, dict) else None
                    text = str(w.get("text") if isinstance(w, dict) else w)
                    kind, tag = _REPORTED.get(str(code), ("reported", str(code) if code else "warn"))
                    add(kind, tag, text)
            else:
                errors, requests = num(lv, "errors"), num(lv, "requests")
                if errors:
                    of = f" of {format_value('requests', requests)}" if requests is not None else ""
                    add("errors", "errors", f"{format_value('errors', errors)}{of} requests failed.")
                if requests is not None and requests < MIN_REQUESTS:
                    add("few_requests", f"n<{MIN_REQUESTS}",
                        f"only {format_value('requests', requests)} requests (fewer than {MIN_REQUESTS}).")
                p50, p95 = num(lv, "ttft_p50_ms"), num(lv, "ttft_p95_ms")
                if p50 and p95 is not None and p95 > SPREAD_RATIO * p50:
                    add("spread", "spread", f"TTFT p95 is {p95 / p50:.1f} × p50 ({format_value('ttft_p95_ms', p95)} "
                        f"vs {format_value('ttft_p50_ms', p50)} ms).")
                if lv.get("client_limited") is True:
                    add("client_limited", "client", "the load generator could not keep up (client-limited).")
            cv = repeat_stats(lv)["cv"]
            if cv is not None and cv >= MAX_CV:
                add("cv", "cv", f"throughput varies by {cv * 100:.1f} % across repeats (CV ≥ {MAX_CV * 100:.0f} %).")
        for x, vals in repeats.items():
            if len(vals) >= 2 and statistics.fmean(vals) > 0:
                cv = statistics.stdev(vals) / statistics.fmean(vals)
                if cv >= MAX_CV:
                    out.append(LevelWarning(
                        "cv", "cv", ri, first_of[x], label, scen,
                        f"{label} at {x_words(x[0])} {fmt_x(*x)}: throughput varies by {cv * 100:.1f} % across "
                        f"{len(vals)} repeats (CV ≥ {MAX_CV * 100:.0f} %)."))
    return out


WARNING_CODES = {
    **LEVEL_WARNING_CODES,  # codes a run recorded itself and shows as recorded
    "failed": "the level failed",
    "errors": "some requests failed",
    f"n<{MIN_REQUESTS}": f"fewer than {MIN_REQUESTS} requests",
    "spread": f"TTFT p95 > {SPREAD_RATIO:g} × p50",
    "cv": f"throughput CV ≥ {MAX_CV * 100:.0f} % across repeats",
    "client": "client-limited",
    "warn": "warning recorded by the run",
}


# ----------------------------------------------------------------------------------------------
# Planner view of a run


@dataclass(frozen=True)
class PlanLevel:
    x: float
    predicted_kv_usage: Optional[float]  # 0..1
    predicts_preemption: Optional[bool]
    predicts_queueing: Optional[bool] = None


@dataclass(frozen=True)
class RunPlan:
    label: str
    source: str  # "run planner" | "levels" | "calibration table"
    kv_bytes_per_token: Optional[float]
    capacity_tokens: Optional[float]
    max_concurrency: Optional[float]  # whole requests before preemption (vLLM)
    levels: tuple[PlanLevel, ...]
    calibrated_capacity_tokens: Optional[float] = None
    calibrated_max_concurrency: Optional[float] = None
    calibrated_levels: tuple[PlanLevel, ...] = ()
    tokens_per_request: Optional[float] = None
    max_concurrent_requests: Optional[float] = None  # served at once before the rest queue


def _plan_levels(rows: Any) -> tuple[PlanLevel, ...]:
    out = []
    for row in rows or []:
        if isinstance(row, dict) and is_num(row.get("concurrency")):
            u = row.get("predicted_kv_usage")
            out.append(PlanLevel(float(row["concurrency"]), float(u) if is_num(u) else None,
                                 row.get("predicts_preemption"), row.get("predicts_queueing")))
    return tuple(sorted(out, key=lambda p: p.x))


def _calibration_row(run: dict, aggregate: dict) -> Optional[dict]:
    kv = (run.get("kv_cache") or {}).get("dtype") or run.get("kv_requested")
    for row in aggregate.get("calibration") or []:
        if isinstance(row, dict) and row.get("model") == run.get("model") and kv and row.get("kv_cache_dtype") == kv:
            return row
    return None


def run_plan(run: dict, aggregate: dict) -> Optional[RunPlan]:
    """The planner's view of a run: its own planner block; else the levels' predicted_kv_usage; else one
    derived from the aggregate's calibration table (capacity = predicted_tokens, each request holding
    prompt + max tokens, usage capped at 100 % as the planner does)."""
    label = str(run.get("label"))
    p = run.get("planner")
    if isinstance(p, dict):
        cal = p.get("calibrated") if isinstance(p.get("calibrated"), dict) else {}
        return RunPlan(
            label, "run planner", num(p, "kv_bytes_per_token"), num(p, "capacity_tokens"),
            num(p, "max_concurrency_before_preemption"), _plan_levels(p.get("levels")),
            num(cal, "capacity_tokens"), num(cal, "max_concurrency_before_preemption"),
            _plan_levels(cal.get("levels")), num(p, "request_tokens"), num(p, "max_concurrent_requests"))
    from_levels = _plan_levels([lv for lv in sorted_levels(run) if is_num(lv.get("predicted_kv_usage"))])
    if from_levels:
        return RunPlan(label, "levels", None, None, None, from_levels)
    row = _calibration_row(run, aggregate)
    prompt, out_tok = num(run, "prompt_tokens"), num(run, "max_tokens")
    if row is None or not num(row, "predicted_tokens") or prompt is None or out_tok is None:
        return None
    per_req = prompt + out_tok

    def levels_for(cap: Optional[float]) -> tuple[PlanLevel, ...]:
        if not cap:
            return ()
        xs = sorted({c for c in (num(lv, "concurrency") for lv in run.get("levels") or []) if c is not None})
        return tuple(PlanLevel(c, min(1.0, c * per_req / cap), c * per_req > cap) for c in xs)

    from kvexp.planning.recompute import kvexp_tokens  # the document's own figure only where kvexp cannot recompute it

    mine = kvexp_tokens(row, aggregate)
    cap, ccap = (mine if mine is not None else num(row, "predicted_tokens")), num(row, "calibrated_tokens")
    bpt = None
    pl = aggregate.get("planner") or {}
    arch = (pl.get("models") or {}).get(row.get("preset") or "")
    kvb = (pl.get("kv_bytes") or {}).get(row.get("kv_cache_dtype"))
    dims = ("n_layers", "n_kv_heads", "head_dim")
    if isinstance(arch, dict) and is_num(kvb) and all(is_num(arch.get(k)) for k in dims):
        bpt = kv_bytes_per_token(arch["n_layers"], arch["n_kv_heads"], arch["head_dim"], kvb)
    return RunPlan(
        label, "calibration table", bpt, cap, math.floor(cap / per_req) if cap else None, levels_for(cap),
        ccap, math.floor(ccap / per_req) if ccap else None, levels_for(ccap), per_req)
