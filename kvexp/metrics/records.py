"""The per-request record: what the load generator measured for one request, raw.

Times are seconds on the load generator's perf_counter clock, relative to the run's origin; every
derived number (TTFT, TPOT, ITL, throughput) is computed from them in stats.py. The record lives here,
at the bottom of the stack, so that statistics, levels and results can name the type the load
generator (kvexp/measure/loadgen.py) fills in."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

ERROR_KINDS = ("timeout", "http_status", "connection", "protocol")


@dataclass
class RequestRecord:
    """One request, raw. Times are seconds on the perf_counter clock, relative to the run's origin."""

    index: int
    level: float  # concurrency (closed loop) or rate in requests/s (open loop)
    repeat: int = 0
    warmup: bool = False
    scheduled_s: Optional[float] = None  # when it was due: its open-loop time, or when its stream was free
    sent_s: Optional[float] = None
    first_token_s: Optional[float] = None
    done_s: Optional[float] = None
    token_times_s: list[float] = field(default_factory=list)  # every token arrival
    target_prompt_tokens: Optional[int] = None
    max_tokens: Optional[int] = None
    prompt_tokens: Optional[int] = None  # the server's own count (usage)
    output_tokens: Optional[int] = None  # the server's own count (usage)
    finish_reason: Optional[str] = None
    http_status: Optional[int] = None
    error_kind: Optional[str] = None  # one of ERROR_KINDS; None: the request succeeded
    error: Optional[str] = None
    server_timings: Optional[dict[str, float]] = None
    # where the request came from in the workload (kvexp/workload/; None: not applicable)
    prefix_group: Optional[int] = None  # which shared prefix it starts with
    conversation: Optional[int] = None  # multi-turn: its conversation and turn (0-based)
    turn: Optional[int] = None
    source_line: Optional[int] = None  # the dataset or trace line it was built from
    # the generated text, kept only when a later turn sends it back as history (never written out)
    text: Optional[list[str]] = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["text"]
        return out
