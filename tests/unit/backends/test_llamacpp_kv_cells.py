"""llama.cpp's KV cells as kvexp reads them, on recorded /slots answers and the tiny GGUF's shape: each cell
counted once, and the exact KV bytes per cache type (the same figures against the real llama-server:
tests/integration/llamacpp/test_truth_llamacpp.py)."""

from __future__ import annotations

import json

import pytest
from conftest import FIXTURES

from kvexp.backends.llamacpp import exact_kv_bytes, slots_usage

FX = FIXTURES / "llamacpp"


def test_slots_usage_counts_each_cell_once():
    # captured while 4 requests of 512 + 256 tokens decoded (-np 4 -c 3136: 4 x 1024 cells): each slot's
    # n_prompt_tokens already holds its decoded tokens (512 + n_decoded, or one less between decodes)
    slots = json.loads((FX / "slots_decoding_np4.json").read_text())
    for s in slots:
        assert s["n_prompt_tokens"] - (512 + s["next_token"][0]["n_decoded"]) in (-1, 0)
    assert slots_usage(slots) == pytest.approx(sum(s["n_prompt_tokens"] for s in slots) / 4096)
    assert slots_usage(slots) <= 4 * 768 / 4096  # never above the physical maximum
    # --kv-unified: one stream of 3,328 cells, which every slot reports as its n_ctx
    unified = json.loads((FX / "slots_decoding_np4_unified.json").read_text())
    assert {s["n_ctx"] for s in unified} == {3328}
    assert slots_usage(unified, unified=True) == pytest.approx(sum(s["n_prompt_tokens"] for s in unified) / 3328)
    idle = [{**s, "is_processing": False} for s in slots]  # an idle slot keeps its count: not in use
    assert slots_usage(idle) == 0.0


def test_exact_kv_bytes_from_cells():
    # tiny GGUF: 2 layers x 64 K/V elements; 5,120 cells: the log says 2.50 / 1.33 / 0.70 MiB
    assert exact_kv_bytes(5120, 2, 64, "f16", "f16") == 2_621_440
    assert exact_kv_bytes(5120, 2, 64, "q8_0", "q8_0") == 1_392_640
    assert exact_kv_bytes(5120, 2, 64, "q4_0", "q4_0") == 737_280
    assert exact_kv_bytes(5120, 2, 64, "iq9", "f16") is None
