"""The KV-dtype card: what each KV configuration saves and costs against the 16-bit cache, on one table
per model, backend and scenario. A row per KV configuration: its KV bytes per token (for a sliding-window
model the per-token part and the window part a sequence holds), the tokens that fit in the 16-bit
cache's memory, the TTFT (prefill) and TPOT (decode) change at each concurrency both measured, each held
against the noise (noise.compare: the repeats' CIs, else a 5 % minimum effect and the levels' own
dispersion; machine load that differed makes a change not comparable), mean KLD, top-1 agreement and
PPL change at the deepest depth measured, and llama.cpp's rotation of a quantised cache.

A slowdown beyond the noise is a finding that names the phase (prefill or decode). Pure: an aggregate
in, JSON-ready cards and Findings out (aggregate.kv_cards, schema/aggregate.schema.json)."""

from __future__ import annotations

from typing import Any, Optional

from kvexp.analysis import documents as D, noise
from kvexp.analysis.qualityfindings import fmt_kld, fmt_share
from kvexp.analysis.verdict import SIXTEEN_BIT
from kvexp.metrics import registry
from kvexp.metrics.registry import is_num
from kvexp.results.blocks import QualityDepth
from kvexp.results.runs import Aggregate, Run

PHASES = (("ttft", "ttft_p50_ms", "prefill"), ("tpot", "tpot_p50_ms", "decode"))


def _deepest(run: Run) -> Optional[QualityDepth]:
    return run.quality.deepest if run.quality is not None else None


def _is_base(run: Run) -> bool:
    return str(run.kv.name or "").lower() in SIXTEEN_BIT


def _change(base: Run, run: Run, metric: str) -> list[dict[str, Any]]:
    """The metric's change from the baseline at each concurrency (or rate) both measured, with its noise."""
    theirs = {lv.x: lv for lv in base.merged_levels() if lv.x and base.usable(lv)}
    out = []
    for lv in run.merged_levels():
        x = lv.x
        if not x or x not in theirs or not run.usable(lv):
            continue
        v = noise.compare(run, lv, base, theirs[x], metric)
        if v is None or v.diff_pct is None:
            continue
        if v.basis == "machine load":
            mark = "not comparable: machine load differed"
        elif v.dispersed:
            mark = "too dispersed to compare"
        elif v.basis == "repeats":
            mark = f"{'beyond' if v.measurable else 'within'} the repeats' 95 % CIs"
        else:
            mark = f"{'beyond' if v.measurable else 'within'} the {v.threshold_pct:.0f} % noise"
        out.append({"kind": x[0], "x": x[1], "change_pct": round(v.diff_pct, 1),
                    "beyond_noise": bool(v.measurable and not v.dispersed and v.basis != "machine load"),
                    "noise": mark})
    return out


def _number(v: Any) -> Optional[float]:
    return float(v) if is_num(v) else None


def _row(run: Run, base: Run) -> dict[str, Any]:
    bpt, base_bpt = run.bytes_per_token, base.bytes_per_token
    window = run.planner.window_bytes_per_sequence if run.planner is not None else None
    base_bytes = _number(base.kv_cache.bytes)
    seqs = _number(base.kv_cache.seqs) or 1
    tokens = None
    if bpt and base_bytes:
        tokens = int((base_bytes - (window or 0) * seqs) // bpt) if base_bytes > (window or 0) * seqs else None
    d, d0 = _deepest(run), _deepest(base)
    delta_ppl = d.delta_ppl if d else None
    if d is not None and delta_ppl is None and is_num(d.ppl) and is_num(d.ppl_base):
        delta_ppl = d.ppl - d.ppl_base  # type: ignore[operator]
    kv = run.kv
    return {
        "label": run.label, "kv": kv.name, "rotation": kv.note,
        "kv_bytes_per_token": bpt, "kv_window_bytes_per_sequence": window,
        "tokens_in_same_memory": tokens, "tokens_ratio": round(base_bpt / bpt, 3) if bpt and base_bpt else None,
        "ttft_change": _change(base, run, "ttft_p50_ms") if run is not base else [],
        "tpot_change": _change(base, run, "tpot_p50_ms") if run is not base else [],
        "kld_mean": d.kld_mean if d else None, "depth": d.context if d else None,
        "top1_agreement": d.top1_agreement if d else None,
        "delta_ppl": delta_ppl, "ppl": d.ppl if d else (d0.ppl_base if d0 and run is base else None),
    }


def kv_cards(aggregate: Aggregate) -> list[dict[str, Any]]:
    """One card per model, backend and scenario that measured a 16-bit cache and at least one other KV
    configuration (complete runs only), rows in order of KV bytes per token, the 16-bit cache first."""
    groups: dict[tuple, list[Run]] = {}
    for r in aggregate.runs:
        if r.state == "complete" and not r.tool and r.kv.name:
            groups.setdefault((str(r.backend), str(r.model), str(r.scenario)), []).append(r)
    cards = []
    for (backend, model, scenario), runs in groups.items():
        bases = [r for r in runs if _is_base(r)]
        others = [r for r in runs if not _is_base(r)]
        if not bases or not others:
            continue
        base = bases[0]
        rows = [_row(base, base)] + sorted((_row(r, base) for r in others),
                                           key=lambda row: row["kv_bytes_per_token"] or float("inf"))
        cards.append({"backend": backend, "model": model.rsplit("/", 1)[-1], "weights": base.weights_text,
                      "scenario": scenario, "baseline": base.kv.name, "rows": rows})
    return cards


def _changes_text(changes: list[dict]) -> str:
    if not changes:
        return "—"
    return "; ".join(f"{c['x']:g}: {c['change_pct']:+.1f} % ({c['noise']})" for c in changes)


CARD_HEADERS = ["KV", "Rotation", "KV bytes/token", "Tokens in the same memory", "TTFT (prefill) change by level",
                "TPOT (decode) change by level", "Mean KLD", "Top-1 agree", "ΔPPL"]


def card_rows(card: dict) -> list[list[str]]:
    """The card as table cells, every number formatted once here."""
    out = []
    for i, row in enumerate(card["rows"]):
        bpt = "—" if row["kv_bytes_per_token"] is None else f"{row['kv_bytes_per_token']:,.0f}"
        bpt += registry.window_words(row["kv_window_bytes_per_sequence"])
        tokens = "—" if row["tokens_in_same_memory"] is None else f"{row['tokens_in_same_memory']:,}"
        if row["tokens_ratio"] is not None and i:
            tokens += f" ({row['tokens_ratio']:.2f}×)"
        base = i == 0
        kld = fmt_kld(row["kld_mean"]) + (f" (depth {row['depth']})" if row["depth"] else "")
        dppl = "—" if row["delta_ppl"] is None else f"{row['delta_ppl']:+.2f}".replace("-0.00", "0.00").replace(
            "+0.00", "0.00")
        out.append([f"{row['kv']} (baseline)" if base else str(row["kv"]), row["rotation"] or "—", bpt, tokens,
                    "baseline" if base else _changes_text(row["ttft_change"]),
                    "baseline" if base else _changes_text(row["tpot_change"]),
                    kld if not base or row["kld_mean"] is not None else "—", fmt_share(row["top1_agreement"]), dppl])
    return out


def card_findings(cards: list[dict]) -> list[D.Finding]:
    """A slowdown beyond the noise, naming its phase: prefill (TTFT) or decode (TPOT)."""
    out = []
    for card in cards:
        for row in card["rows"][1:]:
            for key, _, phase in PHASES:
                slow = [c for c in row[f"{key}_change"] if c["beyond_noise"] and c["change_pct"] > 0]
                if not slow:
                    continue
                at = ", ".join(f"{c['change_pct']:+.1f} % at {D.x_words(c['kind'])} {c['x']:g} ({c['noise']})"
                               for c in slow)
                out.append(D.Finding(
                    "kv_slowdown", f"{D.backend_name(card['backend'])} {row['kv']} KV vs {card['baseline']} "
                    f"({card['scenario']}, {card['model']}): {phase} is slower, {key.upper()} p50 {at}.",
                    card["scenario"], (row["label"],), {"phase": phase, "changes": slow}))
    return out
