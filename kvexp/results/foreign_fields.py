"""Strict types for the fields kvexp reads from other tools' files, checked before kvexp.results.foreign
maps them: a concurrency of -8 or "eight" does not silently become the number of prompts, a median of
"fast" does not silently become "not recorded", and a failed count larger than the prompts sent is not
read as a billion requests. Each problem is one line: the field (its JSON path in the tool's file), its
value and why it is refused. Pure: the caller names the file."""

from __future__ import annotations

import math
import re
from typing import Any, Optional

from kvexp.results import foreign
from kvexp.results.guards import (MAX_LATENCY_MS, MAX_NAME_CHARS, MAX_RATE, MAX_REQUESTS, NOT_PRINTABLE, hidden_char,
                                  show)


class Fields:
    """Checks of one file's fields; `errors` gathers every problem found."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def num(self, holder: Any, where: str, key: str, *, whole: bool = False, low: float = 0.0,
            positive: bool = False, high: Optional[float] = None, unit: str = "", null: bool = True,
            words: tuple[str, ...] = (), meaning: str = "") -> Optional[float]:
        """holder[key] when it is a number in range; None when it is absent, null (where `null`) or one of
        `words` (e.g. vLLM's "inf"); otherwise None and one line in `errors`."""
        if not isinstance(holder, dict) or key not in holder:
            return None
        v = holder[key]
        if (v is None and null) or (isinstance(v, str) and v in words):
            return None
        at = f"{where}.{key}"
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.errors.append(f"{at}: expected {meaning or 'a number'}, found {show(v)}")
            return None
        if not math.isfinite(v):
            if not (words and v == math.inf):  # vLLM's request rate: "inf" (or Infinity) when not limited
                self.errors.append(f"{at}: {v} is not a finite number (NaN, Infinity or out of range)")
            return None
        if (whole and not float(v).is_integer()) or (positive and v <= 0) or v < low:
            bound = " > 0" if positive else f" >= {low:g}"
            self.errors.append(f"{at}: expected {meaning or ('a whole number' if whole else 'a number') + bound}, "
                               f"found {show(v)}")
        elif high is not None and v > high:
            self.errors.append(f"{at}: {v:g}{unit} is above {high:g}{unit}: not a measurement")
        else:
            return v
        return None

    def name(self, holder: Any, where: str, key: str) -> None:
        v = holder.get(key) if isinstance(holder, dict) else None
        if isinstance(v, str) and len(v) > MAX_NAME_CHARS:
            self.errors.append(f"{where}.{key}: {len(v)} characters, more than the {MAX_NAME_CHARS} a name may "
                               "have (a report shows it in every table and chart)")
        elif isinstance(v, str) and (at := hidden_char(v)) is not None:
            self.errors.append(f"{where}.{key}: {v[at]!r} at position {at}: {NOT_PRINTABLE}")

    def ordered(self, where: str, values: list[tuple[str, Optional[float]]]) -> None:
        """Percentiles, lowest first: each at most the next."""
        given = [(k, v) for k, v in values if v is not None]
        for (ka, a), (kb, b) in zip(given, given[1:]):
            if a > b + 1e-9 * max(1.0, abs(b)):
                self.errors.append(f"{where}.{ka}: {a:g} is above {kb} {b:g}; a lower percentile cannot exceed a "
                                   "higher one")


def _obj(v: Any) -> dict:
    return v if isinstance(v, dict) else {}


_VLLM_STAT = re.compile(r"(mean|median|std|p(\d+(?:\.\d+)?))_(\w+)_ms")


def vllm(c: Fields, doc: dict, w: str) -> None:
    """One `vllm bench serve --save-result` object (or one line of an --append-result file)."""
    completed = c.num(doc, w, "completed", whole=True, null=False)
    failed = c.num(doc, w, "failed", whole=True)
    prompts = c.num(doc, w, "num_prompts", whole=True)
    c.num(doc, w, "max_concurrency", whole=True, low=1, meaning="a whole number of requests in flight >= 1 "
          "(or null: no limit)")
    c.num(doc, w, "request_rate", positive=True, words=("inf", "Infinity"),
          meaning='requests per second > 0 (or "inf")')
    c.num(doc, w, "duration", high=MAX_LATENCY_MS / 1000, unit=" s")
    for key in ("request_throughput", "request_goodput"):
        c.num(doc, w, key, high=MAX_RATE, unit=" requests/s")
    for key in ("output_throughput", "total_token_throughput"):
        c.num(doc, w, key, high=MAX_RATE, unit=" tok/s")
    for key in ("total_input_tokens", "total_output_tokens"):
        c.num(doc, w, key, whole=True)
    pcts: dict[str, list[tuple[float, str, Optional[float]]]] = {}
    for key in list(doc):
        m = _VLLM_STAT.fullmatch(key) if isinstance(key, str) else None
        if m:
            v = c.num(doc, w, key, high=MAX_LATENCY_MS, unit=" ms")
            if m[1] != "mean" and m[1] != "std":
                pcts.setdefault(m[3], []).append((50.0 if m[1] == "median" else float(m[2]), key, v))
    for metric in sorted(pcts) if completed else ():  # with no success vLLM writes 0s, and kvexp reads none
        c.ordered(w, [(k, v) for _, k, v in sorted(pcts[metric])])
    done, lost = int(completed or 0), int(failed or 0)
    if completed is not None and failed is not None and prompts is not None and done + lost > prompts:
        c.errors.append(f"{w}.failed: {lost} failed + {done} completed requests is more than the {int(prompts)} "
                        "prompts the run sent (num_prompts)")
    elif completed is not None and done + lost > MAX_REQUESTS:
        field = "failed" if lost > done else "completed"
        c.errors.append(f"{w}.{field}: {int(doc[field])}: {done + lost} requests in one run, more than the "
                        f"{MAX_REQUESTS} kvexp reads in one level")
    for key in ("label", "model_id", "backend", "endpoint_type"):
        c.name(doc, w, key)


_GUIDELLM_DISTS = ("time_to_first_token_ms", "inter_token_latency_ms", "request_latency", "output_tokens_per_second",
                   "requests_per_second", "prompt_token_count", "output_token_count")


def guidellm(c: Fields, doc: dict) -> None:
    """A GuideLLM benchmarks.json: the fields of each benchmark that kvexp maps."""
    for i, b in enumerate(doc["benchmarks"]):
        w = f"$.benchmarks[{i}]"
        totals = b["metrics"].get("request_totals")
        ok = c.num(totals, f"{w}.metrics.request_totals", "successful", whole=True, null=False)
        errored = c.num(totals, f"{w}.metrics.request_totals", "errored", whole=True, null=False)
        if ok is not None and errored is not None and ok + errored > MAX_REQUESTS:
            c.errors.append(f"{w}.metrics.request_totals: {ok + errored:g} requests in one benchmark, more than the "
                            f"{MAX_REQUESTS} kvexp reads in one level")
        strategy = _obj(_obj(b.get("config")).get("strategy"))
        for key in ("streams", "max_concurrency"):
            c.num(strategy, f"{w}.config.strategy", key, whole=True, low=1,
                  meaning="a whole number of requests in flight >= 1")
        c.num(strategy, f"{w}.config.strategy", "rate", meaning="requests per second >= 0 (or null)")
        c.num(b, w, "duration", high=MAX_LATENCY_MS / 1000, unit=" s")
        for key in _GUIDELLM_DISTS:
            d = _obj(_obj(b["metrics"].get(key)).get("successful"))
            at = f"{w}.metrics.{key}.successful"
            high, unit = (MAX_RATE, "/s") if key.endswith("per_second") else (MAX_LATENCY_MS, "")
            for stat in ("mean", "median", "total_sum"):
                c.num(d, at, stat, high=None if stat == "total_sum" else high, unit=unit)
            c.num(d, at, "count", whole=True)
            p = _obj(d.get("percentiles"))
            c.ordered(f"{at}.percentiles", [(q, c.num(p, f"{at}.percentiles", q, high=high, unit=unit))
                                            for q in ("p50", "p95", "p99")])


_AIPERF_TIMES = ("time_to_first_token", "inter_token_latency", "inter_chunk_latency", "request_latency")


def aiperf(c: Fields, doc: dict) -> None:
    """An AIPerf profile_export_aiperf.json: the metrics kvexp maps and the profiling phase's load."""
    for key in _AIPERF_TIMES:
        m = doc.get(key)
        c.ordered(f"$.{key}", [(p, c.num(m, f"$.{key}", p)) for p in ("p50", "p95", "p99")])
    counts = {key: c.num(doc.get(key), f"$.{key}", "avg", whole=True)
              for key in ("request_count", "error_request_count", "total_osl", "total_output_tokens")}
    for key, high, unit in (("output_token_throughput", MAX_RATE, " tok/s"), ("request_throughput", MAX_RATE, "/s"),
                            ("goodput", MAX_RATE, "/s"), ("benchmark_duration", None, ""),
                            ("input_sequence_length", None, ""), ("output_sequence_length", None, "")):
        c.num(doc.get(key), f"$.{key}", "avg", high=high, unit=unit)
    n = (counts["request_count"] or 0) + (counts["error_request_count"] or 0)
    if n > MAX_REQUESTS:
        c.errors.append(f"$.request_count.avg: {int(n)} requests in one run (with error_request_count), more than "
                        f"the {MAX_REQUESTS} kvexp reads in one level")
    cfg = _obj(doc.get("input_config"))
    phases = cfg.get("phases") if isinstance(cfg.get("phases"), list) else []
    for i, ph in enumerate(phases):
        if isinstance(ph, dict) and ph.get("kind", "profiling") == "profiling":
            c.num(ph, f"$.input_config.phases[{i}]", "concurrency", whole=True, low=1,
                  meaning="a whole number of requests in flight >= 1 (or null)")
            c.num(ph, f"$.input_config.phases[{i}]", "request_rate", meaning="requests per second >= 0 (or null)")
            break
    else:
        c.num(cfg.get("loadgen"), "$.input_config.loadgen", "concurrency", whole=True, low=1,
              meaning="a whole number of requests in flight >= 1 (or null)")


def field_errors(doc: Any) -> list[str]:
    """Every problem of the fields kvexp maps from another tool's file ([] for none, or for a file of no
    tool it knows), each 'JSON-path: value: why'."""
    tool = foreign.sniff(doc)
    c = Fields()
    if tool == foreign.VLLM:
        for i, d in enumerate(doc if isinstance(doc, list) else [doc]):
            vllm(c, d, f"$[{i}]" if isinstance(doc, list) else "$")
    elif tool == foreign.GUIDELLM:
        guidellm(c, doc)
    elif tool == foreign.AIPERF:
        aiperf(c, doc)
    return c.errors
