"""What every command that reads a result file (validate, results, report, resume) asks of it before and
after parsing, so that a hostile or corrupt file gets one line and exit status 1 whichever command reads
it, never a hang, a traceback or a report that runs for ever.

Before parsing: a regular file only (a FIFO, a device or a socket is refused from os.stat, before it is
opened, and the open itself never blocks), at most MAX_JSON_BYTES (a requests.jsonl: MAX_JSONL_BYTES in
all, MAX_LINE_BYTES a line), read with a bounded read (a symlink to /dev/zero cannot grow memory), and
nested at most DECODE_DEPTH deep by a scan of the text (the decoder recurses).

After parsing, kvexp's own files (sanity_errors): a TTFT, TPOT, ITL or E2E p50 <= p95 <= p99, each level
(concurrency or rate, and repeat) once in a run, throughput and rates within MAX_RATE per second and
latencies within MAX_LATENCY_MS, names (labels, models, scenarios) at most MAX_NAME_CHARS characters (a
scenario's MAX_SCENARIO_CHARS) and any other text at most MAX_TEXT_CHARS. The schema already says that
counts are whole and not negative, and kvexp.results.validate that numbers are finite."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any, Iterator, Optional

MAX_JSON_BYTES = 64 << 20  # a result, aggregate or other tool's file: kvexp's are at most a few MB
MAX_JSONL_BYTES = 4 << 30  # a requests.jsonl, read line by line (one line per request, token times included)
MAX_LINE_BYTES = 16 << 20  # one line of requests.jsonl
MAX_DEPTH = 32  # nesting of objects and arrays kvexp reads (its own files nest 6 deep, GuideLLM's 9)
DECODE_DEPTH = 512  # deeper than this, the text is refused before the (recursive) decoder sees it
MAX_NAME_CHARS = 1000  # a label, model, scenario, backend or GPU name: shown in every table and chart
MAX_SCENARIO_CHARS = 200  # a scenario's name also names the report's chart files (at most 255 bytes)
MAX_TEXT_CHARS = 64 << 10  # any other text of kvexp's own files (its longest, a server's log tail, is 16 KiB)
MAX_RATE = 1e7  # output tokens or requests per second: no server comes near
MAX_LATENCY_MS = 1e9  # 11.6 days: no request of a benchmark takes that long
MAX_REQUESTS = 1_000_000  # requests in one level (the schema's bound)
MAX_RUN_LEVELS = 1024  # level entries (levels x repeats) of one job: a run config allows no more
MAX_REPEATS = 1000  # scenario.repeats (a level's repeat is 0 .. MAX_REPEATS - 1)
NOT_REGULAR = "not a regular file (a device, FIFO or socket); not a kvexp file"


NOT_PRINTABLE = "a name is shown in tables, logs and terminals, so it may hold only printable characters"


def hidden_char(text: str) -> Optional[int]:
    """Where text first holds a character a terminal acts on (a newline, ESC, a bidi override); None if nowhere.
    Names and titles are shown in files, log lines and tables, so they may hold only printable ones."""
    return next((i for i, c in enumerate(text) if not c.isprintable()), None)


class FileRefused(ValueError):
    """A file too large, not a regular file, or nested too deep; the message is one line."""


def show(v: Any, width: int = 40) -> str:
    """A value as a message quotes it: its repr, cut to `width` characters (a 5 MB string stays short)."""
    if isinstance(v, str) and len(v) > width:
        return repr(v[:width]) + f"... ({len(v)} characters)"
    text = repr(v)
    return text if len(text) <= width else text[:width] + "..."


def size_text(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 and not n % (1 << 30) else f"{n >> 20} MiB" if n >= 1 << 20 \
        else f"{n} bytes"


def open_regular(path: Path, limit: int) -> Any:
    """A regular file opened for reading (binary): os.stat first, so that a FIFO, device or socket is
    refused before it is opened; the open is non-blocking and its fstat checked again (a FIFO swapped in
    between is refused too). FileRefused also for a file larger than `limit`; IsADirectoryError for a
    folder; other OSErrors as the system raises them."""
    st = os.stat(path)
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(21, "Is a directory", str(path))
    if not stat.S_ISREG(st.st_mode):
        raise FileRefused(f"{path}: {NOT_REGULAR}")
    if st.st_size > limit:
        raise FileRefused(f"{path}: larger than {size_text(limit)} ({size_text(st.st_size)}); not a kvexp file")
    f = open(path, "rb", opener=_nonblocking)
    try:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise FileRefused(f"{path}: {NOT_REGULAR}")
        os.set_blocking(f.fileno(), True)
    except BaseException:
        f.close()
        raise
    return f


def _nonblocking(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NONBLOCK)


READ_CHUNK = 1 << 20


def read_regular(path: Path, limit: int) -> bytes:
    """A regular file's bytes, at most `limit` of them (open_regular says what is refused); read with a
    bounded read, so that a file growing while it is read cannot take more."""
    chunks, total = [], 0
    with open_regular(path, limit) as f:
        while total <= limit:  # in pieces: a read of limit + 1 bytes would allocate them all at once
            chunk = f.read(min(READ_CHUNK, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    data = b"".join(chunks)
    if len(data) > limit:
        raise FileRefused(f"{path}: larger than {size_text(limit)}; not a kvexp file")
    return data


def regular_lines(path: Path, limit: int = MAX_JSONL_BYTES,
                  line_limit: int = MAX_LINE_BYTES) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) of a regular file, each line read with a bounded readline: a line longer
    than `line_limit` is yielded cut at line_limit + 1 bytes (the caller sees it is too long)."""
    with open_regular(path, limit) as f:
        n = 0
        while True:
            raw = f.readline(line_limit + 1)
            if not raw:
                return
            n += 1
            yield n, raw
            if len(raw) > line_limit:  # skip the rest of an overlong line, in bounded pieces
                while raw and not raw.endswith(b"\n"):
                    raw = f.readline(line_limit + 1)


_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[][{}]', re.S)


def too_deep(text: str, limit: int = DECODE_DEPTH) -> bool:
    """Whether JSON text nests objects and arrays deeper than `limit`, by a scan of its brackets outside
    strings (no recursion, no parse)."""
    if text.count("[") + text.count("{") <= limit:
        return False
    depth = 0
    for m in _TOKEN.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > limit:
                return True
        elif c in "]}":
            depth -= 1
    return False


# ---------------------------------------------------------------------------------------------- sanity
_PERCENTILES = (("ttft", ("p50", "p95", "p99")), ("tpot", ("p50", "p95", "p99")), ("itl", ("p50", "p95", "p99")),
                ("e2e", ("p50", "p95", "p99")), ("client_queue", ("p50", "p99")))
_RATES = {"throughput_tok_s": "tok/s", "request_rate": "requests/s", "goodput_req_s": "requests/s"}
_NAMES = {"result": (("label",), ("model", "name"), ("model", "path"), ("scenario", "name"), ("backend", "name"),
                     ("backend", "version"), ("gpu", "name"), ("kv_cache", "dtype")),
          "run": (("label",), ("model",), ("scenario",), ("backend",), ("gpu",), ("tool",), ("tool_version",),
                  ("backend_version",))}


def _path(parts: tuple) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)


def _num(v: Any) -> Optional[float]:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _runs(doc: dict, kind: str) -> list[tuple[tuple, dict]]:
    """(path, holder of levels) of a result (the document) or an aggregate (each run)."""
    if kind == "result":
        return [((), doc)]
    runs = doc.get("runs") if kind == "aggregate" else None
    return [(("runs", i), r) for i, r in enumerate(runs) if isinstance(r, dict)] if isinstance(runs, list) else []


def level_errors(parts: tuple, lv: dict) -> list[str]:
    """A level's percentiles in order, its rates and latencies within physical bounds."""
    out = []
    for metric, ps in _PERCENTILES:
        given = [(p, v) for p in ps if (v := _num(lv.get(f"{metric}_{p}_ms"))) is not None]
        for (pa, a), (pb, b) in zip(given, given[1:]):
            if a > b + 1e-9 * max(1.0, abs(b)):
                out.append(f"{_path((*parts, f'{metric}_{pa}_ms'))}: {a:g} is above {metric}_{pb}_ms {b:g}; "
                           f"a lower percentile cannot exceed a higher one")
    for key, unit in _RATES.items():
        v = _num(lv.get(key))
        if v is not None and v > MAX_RATE:
            out.append(f"{_path((*parts, key))}: {v:g} {unit} is above {MAX_RATE:g} {unit}, more than any server "
                       "serves; not a measurement")
    repeat = lv.get("repeat")
    if isinstance(repeat, int) and not isinstance(repeat, bool) and repeat >= MAX_REPEATS:
        out.append(f"{_path((*parts, 'repeat'))}: {repeat:,} is beyond the {MAX_REPEATS:,} repeats a job may have")
    for key, v in lv.items():
        if isinstance(key, str) and key.endswith("_ms") and (x := _num(v)) is not None and x > MAX_LATENCY_MS:
            out.append(f"{_path((*parts, key))}: {x:g} ms is above {MAX_LATENCY_MS:g} ms (11.6 days); "
                       "not a measurement")
    return out


def _where(lv: dict) -> Optional[str]:
    for kind in ("concurrency", "rate"):
        if _num(lv.get(kind)) is not None:
            return f"{kind} {lv[kind]:g}"
    return None


def _get(doc: Any, keys: tuple) -> Any:
    for k in keys:
        doc = doc.get(k) if isinstance(doc, dict) else None
    return doc


def _name_limit(keys: tuple) -> tuple[int, str]:
    if keys[0] == "scenario":
        return MAX_SCENARIO_CHARS, "a scenario's name may have (it names the report's chart files)"
    return MAX_NAME_CHARS, "a name may have (a report shows it in every table and chart)"


def name_errors(doc: Any, names: tuple[tuple, ...], prefix: tuple = ()) -> list[tuple[tuple, str]]:
    """(path, line) of each name longer than MAX_NAME_CHARS (a scenario's: MAX_SCENARIO_CHARS) or holding a
    character a terminal acts on (a newline, ESC)."""
    out = []
    for keys in names:
        v = _get(doc, keys)
        limit, why = _name_limit(keys)
        if isinstance(v, str) and len(v) > limit:
            out.append(((*prefix, *keys), f"{_path((*prefix, *keys))}: {len(v)} characters, more than the {limit} "
                                          f"{why}"))
        elif isinstance(v, str) and (at := hidden_char(v)) is not None:
            out.append(((*prefix, *keys), f"{_path((*prefix, *keys))}: {v[at]!r} at position {at}: {NOT_PRINTABLE}"))
    return out


def _any_long_text(doc: Any) -> bool:
    stack = [doc]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            if isinstance(v, str) and len(v) > MAX_TEXT_CHARS:
                return True
            continue
        for x in v:
            if isinstance(x, (dict, list)):
                stack.append(x)
            elif isinstance(x, str) and len(x) > MAX_TEXT_CHARS:
                return True
    return False


def long_texts(doc: Any) -> list[tuple[tuple, str]]:
    """(path, line) of each string longer than MAX_TEXT_CHARS, in document order (an iterative walk)."""
    if not _any_long_text(doc):  # the common case, without a path for every value
        return []
    out = []
    stack: list[tuple[tuple, Any]] = [((), doc)]
    while stack:
        parts, v = stack.pop()
        if isinstance(v, dict) and len(parts) < MAX_DEPTH:
            stack.extend(reversed([((*parts, k), x) for k, x in v.items()]))
        elif isinstance(v, list) and len(parts) < MAX_DEPTH:
            stack.extend(reversed([((*parts, i), x) for i, x in enumerate(v)]))
        elif isinstance(v, str) and len(v) > MAX_TEXT_CHARS:
            out.append((parts, f"{_path(parts)}: {len(v)} characters, more than the {MAX_TEXT_CHARS} any text of "
                               "a kvexp file may have"))
    return out


def sanity_errors(doc: Any, kind: str) -> list[str]:
    """What a schema cannot say about a kvexp result or aggregate that was read: percentiles out of
    order, a level measured twice, rates and latencies beyond physics, names and texts too long."""
    if not isinstance(doc, dict) or kind not in ("result", "aggregate"):
        return []
    names = name_errors(doc, _NAMES["result"]) if kind == "result" else \
        [e for parts, run in _runs(doc, kind) for e in name_errors(run, _NAMES["run"], parts)]
    named = {parts for parts, _ in names}
    out = [m for _, m in names] + [m for parts, m in long_texts(doc) if parts not in named]
    for parts, run in _runs(doc, kind):
        levels = run.get("levels")
        if isinstance(levels, list) and len(levels) > MAX_RUN_LEVELS:
            out.append(f"{_path((*parts, 'levels'))}: {len(levels):,} levels, more than the {MAX_RUN_LEVELS:,} "
                       "(levels x repeats) a kvexp job measures")
            continue
        seen: dict[tuple, int] = {}
        for i, lv in enumerate(levels if isinstance(levels, list) else []):
            if not isinstance(lv, dict):
                continue
            at = (*parts, "levels", i)
            out += level_errors(at, lv)
            where, repeat = _where(lv), lv.get("repeat") or 0
            if where is None or not isinstance(repeat, int):
                continue
            if (where, repeat) in seen:
                first = _path((*parts, "levels", seen[(where, repeat)]))
                out.append(f"{_path(at)}: {where}, repeat {repeat} again (first at {first}); a run measures each "
                           "level and repeat once")
            seen.setdefault((where, repeat), i)
    return out
