"""llama.cpp adapter: parsers on recorded bytes, then the real llama-server on the tiny GGUF."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from conftest import TINY, FIXTURES

from kvexp.backends.llamacpp import LlamaCpp, extra_args_problem, parse_kv_log, server_flags, slots_usage
from kvexp.backends.openai import parse_sse_line
from kvexp.backends.process import ServerProcess, free_port
from kvexp.app.compose import compose
from kvexp.measure.client import make_session
from kvexp.measure.loadgen import LoadGenerator
from kvexp.metrics.records import RequestRecord
from kvexp.workload.prompts import exact_text, token_pool, token_prompts

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


@pytest.fixture
def server(llama_server, tiny_gguf, tmp_path):
    cfg = compose([*TINY, "kv=q8_0", "scenario.concurrency=[2]"])
    be = LlamaCpp(cfg, str(tiny_gguf), str(llama_server))
    port = free_port()
    proc = ServerProcess(be.launch_argv(port), be.launch_env(port), tmp_path / "server.log", "llama-server")
    proc.start()
    try:
        proc.wait_ready(f"http://127.0.0.1:{port}/health", 30)
        be.base_url = f"http://127.0.0.1:{port}"
        yield be, proc
    finally:
        proc.stop()
    assert proc.exited() is not None


def test_real_server_exact_prompts_forced_output_and_kv(server):
    be, proc = server

    async def go():
        async with make_session(be.base_url, 4, 60, 30) as s:
            kv = await be.kv_cache(s, proc.log_path.read_text())
            pool = await token_pool(be, s, 0)
            lg = LoadGenerator(s, be)
            recs = []
            for i, p in enumerate(token_prompts(pool, 3, 50, 1)):
                recs.append(await lg.send(be.request(p, 12, "completions"), RequestRecord(index=i, level=1)))
            text = await exact_text(be.chat_prompt_tokens, 40, __import__("random").Random(3), s)
            chat = await lg.send(be.request(text, 7, "chat"), RequestRecord(index=9, level=1))
            usage = (await be.poll(s)).kv_usage
            return kv, recs, chat, await be.version(s), usage

    kv, recs, chat, version, usage = asyncio.run(go())
    assert (kv.dtype, kv.dtype_k, kv.dtype_v) == ("q8_0", "q8_0", "q8_0")
    assert kv.capacity_tokens == 512 and kv.seqs == 2  # -c 128 -np 2: 2 x 64, each padded to 256 cells
    for r in recs:
        assert r.ok, r.error
        assert r.prompt_tokens == 50 and r.output_tokens == 12
        assert len(r.token_times_s) == 12 and r.first_token_s > r.sent_s
    assert chat.ok and chat.prompt_tokens == 40 and chat.output_tokens == 7
    assert version
    assert usage == 0.0  # idle after the requests


def test_extra_args_are_read_as_the_servers_own_parser_reads_them(llama_server):
    """The flags and how many values each takes come from the build's own --help; an item llama-server
    would refuse (and exit before it is ready) is named before anything starts."""
    program = str(llama_server)
    flags = server_flags(program)
    assert (flags["-np"], flags["--kv-unified"], flags["-fa"], flags["--control-vector-layer-range"],
            flags["-ot"]) == (1, 0, 1, 2, 1)
    assert extra_args_problem(program, ["--swa_full", "--cache-ram", "0", "-ot", "x=CPU"]) is None
    assert extra_args_problem(program, ["-np8"]) == ("backend.extra_args: '-np8' is not a flag this llama-server "
                                                     "reads; a flag and its value are two items: [-np,8]")
    assert extra_args_problem(program, ["--cache-ram=0"]).endswith("two items: [--cache-ram,0]")
    assert extra_args_problem(program, ["--jinja", "5"]).startswith("backend.extra_args: '5' is not a flag")
    assert extra_args_problem(program, ["--cache-ram"]) == ("backend.extra_args: --cache-ram takes 1 value(s), and "
                                                            "the list ends before them")
    assert server_flags(str(Path(__file__))) == {}  # no --help to read: the server's own parse says
