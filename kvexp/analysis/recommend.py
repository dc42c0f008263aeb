"""One recommendation per scenario and latency objective: the configuration that serves the most
concurrent users (or the highest request rate) within the SLO, with its capacity, its throughput
there, the quality cost of its KV dtype where the run carries a `quality` block, the runner-up and
the margin; or, when nothing meets the SLO, by how much the closest configuration misses.

A run's capacity is its SLO search's answer (result["search"]) where it searched, else the highest
level of its grid below the first one that misses the objectives (kvexp/metrics/search.py's evaluate: the
SLO percentile, averaged over repeats; failed or preempting levels miss). Ties in capacity are broken
by throughput at that level, and a throughput margin is called one only when kvexp/analysis/noise.py finds a
measurable difference. Scenarios with no SLO are ranked by peak throughput (noise-aware the same way)
and say that no objective was set. Pure: aggregates in, JSON-ready dicts out."""

from __future__ import annotations

from typing import Any, Optional

from kvexp.analysis import comparable, documents as D, noise
from kvexp.metrics import search
from kvexp.metrics.levels import Level
from kvexp.metrics.registry import is_num
from kvexp.results.runs import SLO, Aggregate, Run


# The SLO outcome in the same words wherever it is printed (terminal, summary, report, verdict).
SLO_NOT_SET = "no latency objective set"
SLO_MISSED = "missed at every level"


def slo_outcome(cap: Optional[dict[str, Any]]) -> str:
    """"met at 4 concurrent requests", "missed at every level" or "no latency objective set" for a run's
    capacity (capacity(run, slo); None: no objective)."""
    if cap is None:
        return SLO_NOT_SET
    if cap["capacity"] is None:
        return SLO_MISSED
    return f"met at {_fmt_x(cap['kind'], cap['capacity'])}"


def slo_text(slo: Optional[SLO]) -> str:
    if slo is None:
        return "no latency objective"
    p = slo.percentile
    parts = ([f"TTFT {p} ≤ {slo.slo_ttft_ms:g} ms"] if slo.slo_ttft_ms is not None else []) + (
        [f"TPOT {p} ≤ {slo.slo_tpot_ms:g} ms"] if slo.slo_tpot_ms is not None else [])
    return " and ".join(parts)


def quality_summary(run: Run) -> Optional[dict[str, float]]:
    """The numbers of a run's `quality` block that say what its KV dtype costs (KL divergence,
    agreement, perplexity), top level or one level down; None without a block."""
    if run.quality is None:
        return None
    q = run.quality.to_json()  # every number it holds, whatever the block's producer called it
    out: dict[str, float] = {}

    def take(prefix: str, d: dict) -> None:
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, (int, float)) and not isinstance(v, bool) and any(
                    w in k.lower() for w in ("kld", "kl_", "agreement", "ppl", "perplexity", "top1", "same_top")):
                out[key] = float(v)

    take("", q)
    for k, v in q.items():
        if isinstance(v, dict):
            take(f"{k}.", v)
    return out or {}


def _levels_by_x(run: Run, kind: str) -> dict[float, list[Level]]:
    by_x: dict[float, list[Level]] = {}
    for lv in run.levels:
        v = getattr(lv, kind)
        if is_num(v) and (kind == "rate" or not is_num(lv.rate)):
            by_x.setdefault(float(v), []).append(lv)
    return by_x


def _kind(run: Run) -> str:
    kind = run.search.kind if run.search is not None else None
    if kind in search.KINDS:
        return str(kind)
    return "rate" if any(is_num(lv.rate) for lv in run.levels) else "concurrency"


def capacity(run: Run, slo: SLO) -> dict[str, Any]:
    """{kind, capacity (None: nothing meets), level (the capacity's level, merged), probes, miss_pct,
    miss_at, miss_what} for one run against one SLO."""
    kind = _kind(run)
    obj = search.Objectives(kind, slo.slo_ttft_ms, slo.slo_tpot_ms, slo.percentile)
    by_x = _levels_by_x(run, kind)
    probes = [search.evaluate(x, lvs, obj) for x, lvs in sorted(by_x.items())]
    cap = run.search.answer if run.search is not None and run.objectives == slo else search.grid_answer(probes)
    level = run.level_at((kind, cap)) if cap is not None else None
    miss = miss_at = miss_what = None
    if probes and cap is None:
        low = probes[0]
        ratios = []
        if obj.slo_ttft_ms and low.ttft_ms is not None:
            ratios.append((low.ttft_ms / obj.slo_ttft_ms - 1, f"TTFT {obj.percentile} {low.ttft_ms:.1f} ms"))
        if obj.slo_tpot_ms and low.tpot_ms is not None:
            ratios.append((low.tpot_ms / obj.slo_tpot_ms - 1, f"TPOT {obj.percentile} {low.tpot_ms:.2f} ms"))
        if ratios:
            r, what = max(ratios)
            miss, miss_at, miss_what = round(r * 100, 1), low.x, what
    return {"kind": kind, "capacity": cap, "level": level, "miss_pct": miss, "miss_at": miss_at,
            "miss_what": miss_what}


def _entry(run: Run, cap: dict[str, Any]) -> dict[str, Any]:
    lv = cap["level"]
    return {"label": run.label, "backend": run.backend, "kv": run.kv.display,
            "capacity": cap["capacity"], "kind": cap["kind"],
            "throughput_tok_s": lv.number("throughput_tok_s") if lv is not None else None,
            "quality": quality_summary(run)}


def peak_level(run: Run) -> Optional[Level]:
    """The run's usable level of highest throughput (None: no level has one)."""
    best: Optional[Level] = None
    for lv in run.merged_levels():
        v = lv.number("throughput_tok_s")
        if v is not None and run.usable(lv) and lv.x and (best is None or v > (best.number("throughput_tok_s") or 0)):
            best = lv
    return best


def _tput(level: Optional[Level]) -> Optional[float]:
    return level.number("throughput_tok_s") if level is not None else None


def _fmt_x(kind: str, x: Any) -> str:
    return "—" if x is None else (f"{x:g} concurrent requests" if kind == "concurrency" else f"{x:g} requests/s")


def _quality_text(q: Optional[dict[str, float]]) -> str:
    if not q:
        return ""
    return "; quality of its KV dtype: " + ", ".join(f"{k} {v:g}" for k, v in list(q.items())[:4])


def with_slo(scenario: str, slo: SLO, runs: list[Run]) -> dict[str, Any]:
    caps = [(r, capacity(r, slo)) for r in runs]
    meeting = [(r, c) for r, c in caps if c["capacity"] is not None]
    out: dict[str, Any] = {"scenario": scenario, "slo": slo.to_json(), "met": bool(meeting), "best": None,
                           "runner_up": None, "margin": None, "miss": None, "sentence": ""}
    head = f"{scenario}, {slo_text(slo)}"
    if not meeting:
        closest = min((rc for rc in caps if rc[1]["miss_pct"] is not None), key=lambda rc: rc[1]["miss_pct"],
                      default=None)
        if closest is None:
            out["sentence"] = (f"{head}: {SLO_MISSED}: nothing meets the objectives, and no level has the figures "
                               "to say by how much.")
            return out
        r, c = closest
        out["miss"] = {"label": r.label, "at": c["miss_at"], "kind": c["kind"], "miss_pct": c["miss_pct"],
                       "figure": c["miss_what"]}
        out["sentence"] = (f"{head}: {SLO_MISSED}: nothing meets the objectives; the closest, {r.label} "
                           f"({r.kind}), "
                           f"misses by {c['miss_pct']:g} % at its lowest level ({D.x_words(c['kind'])} "
                           f"{c['miss_at']:g}: {c['miss_what']}).")
        return out
    ranked = sorted(meeting, key=lambda rc: (rc[1]["capacity"], _tput(rc[1]["level"]) or 0), reverse=True)
    (br, bc) = ranked[0]
    out["best"] = _entry(br, bc)
    sentence = (f"{head}: {br.label} ({br.kind}) serves the most, {_fmt_x(bc['kind'], bc['capacity'])} "
                f"within the objectives")
    tput = out["best"]["throughput_tok_s"]
    if tput is not None:
        sentence += f", {tput:.1f} tok/s there"
    sentence += _quality_text(out["best"]["quality"])
    if len(ranked) > 1:
        rr, rc = ranked[1]
        out["runner_up"] = _entry(rr, rc)
        diff = bc["capacity"] - rc["capacity"]
        margin: dict[str, Any] = {"capacity": diff, "capacity_pct": round(diff / rc["capacity"] * 100, 1)
                                  if rc["capacity"] else None}
        v = None
        if diff == 0 and bc["level"] and rc["level"]:
            v = noise.compare(br, bc["level"], rr, rc["level"], "throughput_tok_s")
            if v is not None:
                margin.update(throughput_pct=None if v.diff_pct is None else round(v.diff_pct, 1), **v.numbers())
        out["margin"] = margin
        if diff > 0:
            pct = "" if margin["capacity_pct"] is None else f", +{margin['capacity_pct']:g} %"
            sentence += (f"; runner-up {rr.label} ({rr.kind}), {_fmt_x(rc['kind'], rc['capacity'])} "
                         f"(margin {diff:g}{pct})")
        elif v is not None and not v.measurable:
            sentence += (f"; {rr.label} ({rr.kind}) serves as many, and their throughput there shows "
                         f"{v.phrase}: either will do")
        else:
            sentence += (f"; runner-up {rr.label} ({rr.kind}) serves as many"
                         + (f" at lower throughput, {v.phrase}" if v is not None else ""))
    out["sentence"] = sentence + "."
    return out


def _without_slo(scenario: str, runs: list[Run]) -> Optional[dict[str, Any]]:
    peaks = [(r, lv) for r in runs for lv in [peak_level(r)] if lv is not None]
    if not peaks:
        return None
    peaks.sort(key=lambda rl: _tput(rl[1]) or 0, reverse=True)
    (br, bl) = peaks[0]
    kind, x = bl.x  # type: ignore[misc]
    best = {"label": br.label, "backend": br.backend, "kv": br.kv.display,
            "capacity": None, "kind": kind, "at": x, "throughput_tok_s": _tput(bl),
            "quality": quality_summary(br)}
    out: dict[str, Any] = {"scenario": scenario, "slo": None, "met": None, "best": best, "runner_up": None,
                           "margin": None, "miss": None}
    head = f"{scenario}, no latency objective set (scenario.slo_ttft_ms / slo_tpot_ms): by peak throughput, "
    first = (f"{br.label} ({br.kind}), {best['throughput_tok_s']:.1f} tok/s at "
             f"{D.x_words(kind)} {x:g}{_quality_text(best['quality'])}")
    sentence = head + first
    if len(peaks) > 1:
        rr, rl = peaks[1]
        rk, rx = rl.x  # type: ignore[misc]
        out["runner_up"] = {"label": rr.label, "backend": rr.backend, "kv": rr.kv.display,
                            "capacity": None, "kind": rk, "at": rx, "throughput_tok_s": _tput(rl),
                            "quality": quality_summary(rr)}
        v = noise.compare(br, bl, rr, rl, "throughput_tok_s")
        if v is not None:
            out["margin"] = {"throughput_pct": None if v.diff_pct is None else round(v.diff_pct, 1), **v.numbers()}
            second = (f"{rr.label} ({rr.kind}), {out['runner_up']['throughput_tok_s']:.1f} tok/s at "
                      f"{D.x_words(rk)} {rx:g}")
            sentence = (f"{head}{first}; runner-up {second}: {v.phrase}" if v.measurable
                        else f"{head}{first} and {second} tie: {v.phrase}")
    out["sentence"] = sentence + "."
    return out


def recommendations(aggregate: Aggregate) -> list[dict[str, Any]]:
    """One recommendation per scenario, SLO and field of comparable runs (comparable.partition: partial,
    failed and skipped runs, copies, unconfirmed KV dtypes, other weights or machine load are not ranked)
    (schema/aggregate.schema.json `recommendations`)."""
    out: list[dict[str, Any]] = []
    for scen, runs in aggregate.scenarios():
        groups: dict[Optional[SLO], list[Run]] = {}
        for r in runs:
            groups.setdefault(r.objectives, []).append(r)
        slos = [k for k in groups if k is not None]
        for slo in slos or [None]:
            for f in comparable.partition(groups.get(slo) or [])[0]:
                rec = with_slo(scen, slo, list(f.runs)) if slo is not None else _without_slo(scen, list(f.runs))
                if rec is not None:
                    out.append(rec)
    return out


def ranked(runs: list[Run]) -> list[Run]:
    """A scenario's runs, best first, for a report that shows only the best few of many: complete runs
    before partial ones before the rest; then, where a run set a latency objective, those that meet it
    by their capacity within it (and their throughput there); then by peak throughput. Runs with nothing
    measured keep their order at the end. Each run's figures are read once (a linear pass and a sort)."""
    rank = {"complete": 0, "partial": 1}

    def key(run: Run) -> tuple:
        slo = run.objectives
        cap = capacity(run, slo) if slo is not None else None
        peak = peak_level(run)
        at = cap["level"] if cap is not None and cap["capacity"] is not None else peak
        tput = _tput(at)
        return (rank.get(run.state, 2), cap is None or cap["capacity"] is None,
                -(cap["capacity"] if cap is not None and cap["capacity"] is not None else 0.0),
                tput is None, -(tput or 0.0))

    keys = {id(r): key(r) for r in runs}
    return sorted(runs, key=lambda r: keys[id(r)])
