"""The JSONL files a scenario names (a dataset or a trace): read line by line, cached, each bad line
refused in one DataError naming the file, the line and the field; "@name" is a file kvexp ships in
kvexp/workload/datasets/. kvexp never downloads a dataset."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from kvexp.core.config import ConfigError
from kvexp.core.paths import file_problem

DATASETS_DIR = Path(__file__).parent / "datasets"


class DataError(ConfigError):
    """A dataset or trace file that cannot be used; the message is one line naming the file, the
    line and the field."""


class LineError(Exception):
    """A problem with one line, turned into a DataError naming the file and line."""


# One line (one dataset entry or trace row) may hold at most this many bytes: 8 MiB is far beyond the
# longest prompt a server takes (MAX_TOKENS tokens of a few bytes each), so a longer line is a broken
# file, refused before its text is sent anywhere.
MAX_LINE_BYTES = 8 << 20
_CACHE: dict[tuple, list] = {}
_CACHE_SIZE = 8


def check_line(cond: bool, msg: str) -> None:
    if not cond:
        raise LineError(msg)


def type_name(v: Any) -> str:
    """A JSON value's type as a message names it: object, list, string, null..."""
    names = {dict: "object", list: "list", str: "string", bool: "bool", int: "int", float: "float"}
    return "null" if v is None else names.get(type(v), type(v).__name__)


def short(v: Any, limit: int = 40) -> str:
    """repr(v), cut to `limit` characters."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def read_jsonl(path: str | Path, parse: Callable[[int, Any], Any]) -> list:
    """parse(line_number, json_value) of every non-blank line of a UTF-8 JSONL file, cached on the
    file's resolved path, modification time and size. parse raises LineError for a bad line."""
    shown = str(path)
    p = Path(path).expanduser()
    try:
        st = p.stat()
        key = (str(p.resolve()), st.st_mtime_ns, st.st_size, parse)
    except OSError as e:
        raise DataError(f"{shown}: cannot read: {e.strerror or e}") from None
    problem = file_problem(p)
    if problem:
        raise DataError(f"{shown}: {problem}")
    if key in _CACHE:
        return list(_CACHE[key])
    out = []
    try:
        with p.open("rb") as f:
            for n, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
                if len(raw) > MAX_LINE_BYTES:
                    raise DataError(f"{shown} line {n}: longer than {MAX_LINE_BYTES:,} bytes, far beyond any prompt "
                                    "a server takes; is it the right file?")
                try:
                    text = raw.decode("utf-8-sig" if n == 1 else "utf-8")
                except UnicodeDecodeError:
                    raise DataError(f"{shown} line {n}: not UTF-8") from None
                if not text.strip():
                    continue
                if not out and text.lstrip().startswith("["):  # ShareGPT's files are one JSON array
                    raise DataError(f"{shown} line {n}: a JSON array: kvexp reads JSONL, one object per line "
                                    f"(convert with `jq -c '.[]' {shown}`)")
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as e:
                    raise DataError(f"{shown} line {n}: not JSON ({e.msg} at column {e.colno})") from None
                except RecursionError:
                    raise DataError(f"{shown} line {n}: not JSON (nested too deeply)") from None
                try:
                    out.append(parse(n, value))
                except LineError as e:
                    raise DataError(f"{shown} line {n}: {e}") from None
    except OSError as e:
        raise DataError(f"{shown}: cannot read: {e.strerror or e}") from None
    if not out:
        raise DataError(f"{shown}: no entries")
    while len(_CACHE) >= _CACHE_SIZE:
        del _CACHE[next(iter(_CACHE))]
    _CACHE[key] = out
    return list(out)


def resolve_path(name: str) -> Path:
    """"@name" (or "@name" without .jsonl) is a file kvexp ships in kvexp/workload/datasets/; anything
    else is a path (~ expanded)."""
    if not name.startswith("@"):
        return Path(name).expanduser()
    shipped = shipped_names()
    for cand in (name[1:], name[1:] + ".jsonl"):
        if cand in shipped:
            return DATASETS_DIR / cand
    raise DataError(f"{name}: kvexp ships no such file (shipped: {', '.join('@' + s for s in shipped) or 'none'})")


def shipped_names() -> list[str]:
    """Names of the files in kvexp/workload/datasets/."""
    return sorted(p.name for p in DATASETS_DIR.glob("*.jsonl")) if DATASETS_DIR.is_dir() else []


def shipped_or_given(path: str | Path) -> str | Path:
    """A "@name" string as the shipped file it names; any other path as given (shown as given)."""
    return resolve_path(path) if isinstance(path, str) and path.startswith("@") else path
