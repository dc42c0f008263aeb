"""The registry's definitions are where readers look: docs/METRICS.md and the result schema's level
descriptions are generated from kvexp/metrics/registry.py and must be current."""

from __future__ import annotations

import json

from kvexp.app.metricdocs import docs_path, metrics_markdown, schema_with_docs
from kvexp.core.paths import data_dir
from kvexp.metrics.registry import METRICS

HINT = "run `python -m kvexp.app.metricdocs` after changing kvexp/metrics/registry.py"


def test_metrics_doc_is_current():
    assert docs_path().read_text() == metrics_markdown(), HINT


def test_schema_descriptions_are_the_registry_definitions():
    schema = json.loads((data_dir("schema") / "result.schema.json").read_text())
    assert schema == schema_with_docs(json.loads(json.dumps(schema))), HINT


def test_every_stored_metric_is_a_level_field_of_the_schema():
    props = json.loads((data_dir("schema") / "result.schema.json").read_text())["$defs"]["level"]["properties"]
    for m in METRICS.values():
        head = m.key.partition(".")[0]
        assert not m.stored or head in props, f"{m.key}: registered but not a level field of result.schema.json"
        assert m.doc, f"{m.key}: no definition"
