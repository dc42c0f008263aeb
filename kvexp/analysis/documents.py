"""Reading aggregate documents (kvexp's, the reference document's, other tools' levels mapped onto
kvexp's keys): a level's value by registry key, its x (concurrency or rate), repeats merged, what a
run calls its backend and KV dtype, and the `Finding` every analysis rule returns.

Pure: nothing here prints, plots or reads files. Missing is None throughout: a level without a value
is skipped, never treated as 0."""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from kvexp import backends
from kvexp.metrics.levels import level_x
from kvexp.metrics.registry import METRICS, format_value, is_num, level_value

# Figures a backend may not expose (registry: exposure): null means "not exposed", never 0.
EXPOSURE_KEYS = tuple(k for k, m in METRICS.items() if m.exposure)

_LABEL_KV = re.compile(r"(?:^|[-_.])(fp32|f32|fp16|f16|bf16|fp8|q8_0|q8|q5_1|q5_0|q4_1|q4_0|q4)[-_]?kv(?:$|[-_.])",
                       re.IGNORECASE)


def backend_name(backend: Optional[str]) -> str:
    return backends.display_name(backend)


def caps_output_only(run: dict) -> bool:
    """The run's backend can only cap output length (used when a run does not record variable_length)."""
    adapter = backends.find(run.get("backend"))
    return adapter is not None and not adapter.capabilities.forces_output_length


def num(d: dict, key: str) -> Optional[float]:
    v = level_value(d, key)
    return float(v) if is_num(v) else None


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


@dataclass(frozen=True)
class Finding:
    kind: str  # best_throughput | best_ttft_p95 | best_overall_throughput | best_overall_ttft_p95 | kv_gain
    #           | no_growth | saturation | preemption | no_preemption | not_exposed | variable_length | kv_unconfirmed
    #           | failed | partial | failed_level
    sentence: str
    scenario: Optional[str] = None
    runs: tuple[str, ...] = ()
    numbers: dict[str, Any] = field(default_factory=dict)


def first_line(text: Any, limit: int = 200) -> str:
    lines = [ln.strip() for ln in str(text or "").splitlines() if ln.strip()]
    if not lines:
        return ""
    line = lines[-1] if len(lines) > 1 else lines[0]  # a log tail ends with the cause
    return line if len(line) <= limit else line[: limit - 1] + "…"
