"""What every analysis rule shares: the `Finding` each returns, how sentences write a level's x
(concurrency or rate) and a backend, and a status reason's one line. What a run is (its KV dtype, kind,
weights, levels with repeats merged, the figures it exposes) is the run's own (kvexp.results.runs.Run).

Pure: nothing here prints, plots or reads files. Missing is None throughout: a level without a value
is skipped, never treated as 0."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from kvexp import backends
from kvexp.metrics.registry import METRICS, format_value, is_num  # noqa: F401 (is_num: read from here too)

# Figures a backend may not expose (registry: exposure): null means "not exposed", never 0.
EXPOSURE_KEYS = tuple(k for k, m in METRICS.items() if m.exposure)


def backend_name(backend: Optional[str]) -> str:
    return backends.display_name(backend)


def x_words(kind: str) -> str:
    return "concurrency" if kind == "concurrency" else "request rate"


def fmt_x(kind: str, x: float) -> str:
    return format_value(kind, x) + (" req/s" if kind == "rate" else "")


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
