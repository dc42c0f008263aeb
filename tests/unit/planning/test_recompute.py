"""Foreign documents are recomputed, not echoed: the reference document's planner inputs re-planned by
kvexp's own planner, shown beside the document's figures, disagreements flagged."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from kvexp.planning import recompute
from kvexp.report import render as R
from kvexp.results.runs import Aggregate


@pytest.fixture(scope="module")
def reference(reference_path: Path) -> dict:
    if not reference_path.is_file():
        pytest.skip(f"reference document missing: {reference_path}")
    return json.loads(reference_path.read_text())


def _wrong(ref: dict) -> dict:
    doc = copy.deepcopy(ref)
    doc["calibration"][0]["predicted_tokens"] = 100000
    doc["calibration"][1]["predicted_tokens"] = 222222
    return doc


def test_the_reference_is_reproduced_from_its_own_inputs(reference):
    checks = recompute.check_document(Aggregate.from_json(reference))
    assert [(c.backend, c.kv_dtype, c.kvexp_tokens, c.agrees) for c in checks] == [
        ("vllm", "auto", 143040, True), ("vllm", "fp8", 286096, True)]
    assert [c.kvexp_error_pct for c in checks] == [-9.5, 5.1]


def test_wrong_document_figures_are_flagged_and_kvexps_are_used(reference):
    checks = recompute.check_document(Aggregate.from_json(_wrong(reference)))
    assert [(c.document_tokens, c.kvexp_tokens, c.agrees) for c in checks] == [
        (100000, 143040, False), (222222, 286096, False)]
    assert "(100,000 tokens) disagrees with kvexp's planner on the same inputs (143,040 tokens)" in checks[0].sentence


def test_rows_kvexp_cannot_recompute_say_why(reference):
    doc = copy.deepcopy(reference)
    doc["calibration"][0]["preset"] = "no-such-model"
    doc["calibration"][1]["model"] = "a model no run serves"
    a, b = recompute.check_document(Aggregate.from_json(doc))
    assert a.kvexp_tokens is None and "preset 'no-such-model'" in a.reason
    assert b.kvexp_tokens is None and "backend" in b.reason and b.agrees is None


def test_the_report_shows_kvexps_figures_beside_the_documents(reference, tmp_path, monkeypatch):
    monkeypatch.setenv("KVEXP_CALIBRATION", str(tmp_path / "none.json"))
    R.render_report(Aggregate.from_json(_wrong(reference)), tmp_path, formats=("md",))
    text = (tmp_path / "report.md").read_text()
    findings = text.split("## Findings", 1)[1].split("## Setup", 1)[0]
    assert "Planner predictions, recomputed by kvexp" in findings
    assert "(100,000 tokens) disagrees with kvexp's planner on the same inputs (143,040 tokens)" in findings
    assert "(222,222 tokens) disagrees with kvexp's planner on the same inputs (286,096 tokens)" in findings
    cal = text.split("### Calibration: predicted vs actual KV capacity", 1)[1]
    rows = [ln.split("|") for ln in cal.splitlines() if ln.startswith("| Qwen/")]
    assert [(r[7].strip(), r[10].strip(), r[12].strip()) for r in rows] == [
        ("100000", "143040", "DISAGREES: document 100,000"), ("222222", "286096", "DISAGREES: document 222,222")]
    # the planner's capacity and the preemption point come from kvexp's figures, not the document's
    cap = text.split("### KV capacity per configuration", 1)[1].split("###", 1)[0]
    assert "| 143040 |" in cap and "| 286096 |" in cap and "100000" not in cap
    pre = text.split("### Predicted preemption point per scenario", 1)[1].split("###", 1)[0]
    assert "| long | vllm-fp16kv-long | 4352 | 32 | 48 |" in pre
    # and the what-if table starts from the same recomputed inputs
    whatif = text.split("### What if: these configurations on other GPUs", 1)[1]
    assert "| NVIDIA GeForce RTX 5070 Ti | 15.92 | qwen2.5-7b | vllm | auto | long | 4,352 | 143,040 | 32 |" in whatif
    assert "| NVIDIA H200 | 140.40 |" in whatif


def test_a_document_that_agrees_says_so(reference, tmp_path, monkeypatch):
    monkeypatch.setenv("KVEXP_CALIBRATION", str(tmp_path / "none.json"))
    R.render_report(Aggregate.from_json(copy.deepcopy(reference)), tmp_path, formats=("md",))
    text = (tmp_path / "report.md").read_text()
    assert "kvexp's planner reproduces the document's prediction for qwen2.5-7b auto on 15.92 GiB: 143,040 tokens." in text
    assert "DISAGREES" not in text
