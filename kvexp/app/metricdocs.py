"""The metric registry's definitions, written where people and tools read them: docs/METRICS.md (one
row per figure) and the description of each level figure in schema/result.schema.json. A test checks
that both are current; `python -m kvexp.app.metricdocs` rewrites them after a change to
kvexp/metrics/registry.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvexp.core.paths import atomic_write, data_dir
from kvexp.metrics.levels import WARNING_CODES
from kvexp.metrics.registry import METRICS, Metric

HEAD = """# Metric definitions

Generated from `kvexp/metrics/registry.py` by `python -m kvexp.app.metricdocs` (a test checks it is
current). Stored values keep their key's unit (ms, GiB, tok/s; fractions for percentages); tables write
them in the unit and format below. A null value is unknown: "not exposed" where the backend does not
report a figure it may not expose, "not recorded" where another tool's file does not hold it, "—"
otherwise. "Not firm when" lists the level warnings that qualify a figure.

| key | column | better | not firm when | definition |
|---|---|---|---|---|
"""


def _row(m: Metric) -> str:
    flags = ", ".join(f"`{c}`" for c in m.disqualified_by) or "—"
    notes = [m.doc]
    if m.exposure:
        notes.append("may be not exposed")
    if m.repeated:
        notes.append("summarised over repeats")
    if not m.stored:
        notes.append("derived by the report")
    return f"| `{m.key}` | {m.header} | {m.better or '—'} | {flags} | {'; '.join(notes)} |"


def metrics_markdown() -> str:
    codes = "\n".join(f"- `{c}`: {t}" for c, t in WARNING_CODES.items())
    return HEAD + "\n".join(_row(m) for m in METRICS.values()) + "\n\n## Level warnings\n\n" + codes + "\n"


def schema_with_docs(schema: dict) -> dict:
    """The result schema with each stored, top-level level figure described by its registry definition."""
    props = schema["$defs"]["level"]["properties"]
    for m in METRICS.values():
        if m.stored and "." not in m.key and m.key in props:
            props[m.key]["description"] = m.doc
    return schema


def docs_path() -> Path:
    return data_dir("docs") / "METRICS.md"


def main() -> int:
    atomic_write(docs_path(), metrics_markdown())
    path = data_dir("schema") / "result.schema.json"
    schema = schema_with_docs(json.loads(path.read_text()))
    atomic_write(path, json.dumps(schema, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {docs_path()} and {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
