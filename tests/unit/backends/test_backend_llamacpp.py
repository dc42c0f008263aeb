"""llama.cpp adapter: parsers on recorded bytes (the real llama-server:
tests/integration/llamacpp/test_backend_llamacpp_real.py)."""

from __future__ import annotations

import json

import pytest

from conftest import TINY, FIXTURES

from kvexp.backends.llamacpp import LlamaCpp, parse_kv_log, slots_usage
from kvexp.backends.openai import parse_sse_line
from kvexp.app.compose import compose

FX = FIXTURES / "llamacpp"


def events(name: str):
    return [e for line in (FX / name).read_bytes().splitlines() if (e := parse_sse_line(line)) is not None]


def test_completions_stream_parses():
    ev = events("sse_completions.txt")
    assert sum(e.content for e in ev) == 5  # five characters; the final empty-text chunk is no token
    final = [e for e in ev if e.output_tokens is not None][0]
    assert (final.prompt_tokens, final.output_tokens, final.finish_reason) == (20, 5, "length")
    t = final.server_timings
    assert {k: t[k] for k in ("prompt_s", "predicted_s")} == pytest.approx({"prompt_s": 0.000671, "predicted_s": 0.001266})
    assert (t["prompt_n"], t["predicted_n"], t["cache_n"]) == (20, 5, 0)
    assert t["predicted_per_token_s"] == pytest.approx(0.0003165)  # the server's TPOT
    assert ev[-1].done


def test_chat_stream_parses_without_counting_the_role_chunk():
    ev = events("sse_chat_completions.txt")
    assert sum(e.content for e in ev) == 8
    assert [e.output_tokens for e in ev if e.output_tokens is not None] == [8]
    assert ev[-1].done


def test_bad_lines_are_protocol_errors():
    assert parse_sse_line(b"data: {not json").error.startswith("protocol: malformed JSON")
    assert parse_sse_line(b"<html>").error.startswith("protocol: not an SSE data line")
    assert parse_sse_line(b'data: {"error": {"message": "boom"}}').error == "server: boom"
    assert parse_sse_line(b"") is None and parse_sse_line(b": keep-alive") is None


def test_kv_log_line_every_type():
    for line in (FX / "kv_cache_sizes_by_type.txt").read_text().splitlines():
        if not line.startswith(("f16", "q8_0", "q4_0")):
            continue
        dtype = line.split(":")[0]
        info = parse_kv_log("llama_kv_cache: size = " + line.split("size =", 1)[1])
        assert info.dtype == dtype and info.capacity_tokens == 4 * 1024 and info.seqs == 4  # 4 streams
    q8 = parse_kv_log("llama_kv_cache: size =    1.06 MiB (  1024 cells,   2 layers,  4/4 seqs), "
                      "K (q8_0):    0.53 MiB, V (q8_0):    0.53 MiB")
    # 4 streams x 1024 cells x 2 layers x (64 K + 64 V elements) x 34/32 bytes = 1.0625 MiB
    assert q8.bytes == round(1.06 * 2**20)
    assert q8.capacity_tokens * 2 * 128 * 34 / 32 == 1.0625 * 2**20
    mixed = parse_kv_log((FX / "kv_cache_sizes_by_type.txt").read_text().splitlines()[-1])
    assert (mixed.dtype, mixed.dtype_k, mixed.dtype_v, mixed.capacity_tokens) == ("q8_0/f16", "q8_0", "f16", 4096)
    assert parse_kv_log("no such line") is None


def test_real_log_sample():
    info = parse_kv_log((FX / "server-log-lv4-sample.txt").read_text())
    assert (info.dtype, info.capacity_tokens, info.seqs) == ("f16", 512, 1)


def test_slots_usage():
    busy = json.loads((FX / "slots_busy.json").read_text())
    # n_prompt_tokens (756) already holds the 752 decoded tokens (tests/unit/backends/test_llamacpp_kv_cells.py): counted once
    assert slots_usage(busy) == pytest.approx(756 / 4096)
    assert slots_usage(json.loads((FX / "slots_idle.json").read_text())) == 0.0
    assert slots_usage([]) is None


def test_launch_argv_maps_kv_and_slots():
    cfg = compose([*TINY, "kv=q8_0", "scenario.concurrency=[1,4]"])
    argv = LlamaCpp(cfg, "/m.gguf", "/bin/llama-server").launch_argv(1234)
    assert argv[:3] == ["/bin/llama-server", "-m", "/m.gguf"]
    for flag, value in (("-ctk", "q8_0"), ("-ctv", "q8_0"), ("-np", "4"), ("-c", str(4 * (32 + 16 + 16))),
                        ("--port", "1234"), ("--host", "127.0.0.1"), ("-fa", "on"), ("-lv", "4")):
        assert argv[argv.index(flag) + 1] == value
    assert "--metrics" in argv and "--slots" in argv
