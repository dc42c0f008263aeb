"""A trace file: Mooncake's JSONL (timestamp ms, input_length, output_length, hash_ids), read into
TraceRow objects; when each row is sent; and the prompt of a row, built from one seeded block of token
ids per hash id, so rows that share hash ids share a prompt prefix."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from kvexp.core.config import MAX_TOKENS, ScenarioConfig
from kvexp.workload.files import DataError, check_line, read_jsonl, resolve_path, shipped_or_given, short, type_name
from kvexp.workload.values import is_int, is_num


@dataclass(frozen=True)
class TraceRow:
    line: int
    timestamp_s: float  # seconds since the trace's start (the file gives milliseconds)
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


TRACE_FIELDS = ("timestamp", "input_length", "output_length")


def _fmt(x: float) -> str:
    """A number as a person wrote it: 120, 120.5 (never 1.2e+02)."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _trace_row(n: int, obj: Any) -> TraceRow:
    check_line(isinstance(obj, dict), f"expected an object with {', '.join(TRACE_FIELDS)}, got {type_name(obj)}")
    for k in TRACE_FIELDS:
        check_line(k in obj, f"{k}: missing (each line needs {', '.join(TRACE_FIELDS)})")
    ts = obj["timestamp"]
    check_line(is_num(ts) and ts >= 0, f"timestamp: {short(ts)} must be a finite number >= 0 (milliseconds)")
    for k in ("input_length", "output_length"):
        v = obj[k]
        check_line(is_int(v) and 1 <= v <= MAX_TOKENS, f"{k}: {short(v)} must be an integer in 1..{MAX_TOKENS:,}")
    ids = obj.get("hash_ids")
    ids = [] if ids is None else ids
    check_line(isinstance(ids, list), f"hash_ids: expected a list of integers >= 0, got {type_name(ids)}")
    for i, h in enumerate(ids):
        check_line(is_int(h) and h >= 0, f"hash_ids[{i}]: {short(h)} must be an integer >= 0")
    return TraceRow(line=n, timestamp_s=ts / 1000.0, input_length=obj["input_length"],
                    output_length=obj["output_length"], hash_ids=tuple(ids))


def load_trace(path: str | Path) -> list[TraceRow]:
    """Every row of a Mooncake JSONL trace, in file order, timestamps non-decreasing. Raises DataError
    naming the file, line and field."""
    path = shipped_or_given(path)
    shown = str(path)
    rows = read_jsonl(path, _trace_row)
    for prev, row in zip(rows, rows[1:]):
        if row.timestamp_s < prev.timestamp_s:
            raise DataError(f"{shown} line {row.line}: timestamp: {_fmt(row.timestamp_s * 1000)} is before "
                            f"the previous line's {_fmt(prev.timestamp_s * 1000)}")
    return rows


def trace_offsets(rows: Sequence[TraceRow], time_scale: float) -> list[float]:
    """When each row is sent, in seconds after the first, stretched by time_scale."""
    if not rows:
        return []
    t0 = rows[0].timestamp_s
    return [(r.timestamp_s - t0) * time_scale for r in rows]


def trace_prompt(row: TraceRow, pool: list[int], block_tokens: int, seed: int, index: int) -> list[int]:
    """Exactly row.input_length token ids: one seeded block of block_tokens ids per hash id (equal
    hash ids give equal blocks, so rows sharing leading hash ids share a prefix), cut to length; what
    the blocks leave short is filled with ids of this row alone (seeded by index)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens={block_tokens}: must be >= 1")
    if not pool:
        raise ValueError("the token pool is empty")
    out: list[int] = []
    for h in row.hash_ids:
        if len(out) >= row.input_length:
            break
        out.extend(random.Random(f"block:{seed}:{h}").choices(pool, k=block_tokens))
    del out[row.input_length:]
    out.extend(random.Random(f"tail:{seed}:{index}").choices(pool, k=row.input_length - len(out)))
    return out


def trace_rows(s: ScenarioConfig) -> list[TraceRow]:
    """The rows a trace scenario replays: the first scenario.requests of its file."""
    return load_trace(resolve_path(s.trace or ""))[:s.requests]


def trace_rate(s: ScenarioConfig) -> float:
    """A trace's mean arrival rate at its time scale (requests/s): the value of its one level."""
    offsets = trace_offsets(trace_rows(s), s.time_scale)
    return float(f"{(len(offsets) - 1) / offsets[-1]:.4g}")  # check_scenario: the span is > 0
