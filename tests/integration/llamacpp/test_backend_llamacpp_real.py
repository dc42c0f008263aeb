"""The llama.cpp adapter on the real llama-server and the tiny GGUF (its parsers on recorded bytes:
tests/unit/backends/test_backend_llamacpp.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from conftest import TINY

from kvexp.backends.llamacpp import LlamaCpp, extra_args_problem, server_flags
from kvexp.backends.process import ServerProcess, free_port
from kvexp.app.compose import compose
from kvexp.measure.client import make_session
from kvexp.measure.loadgen import LoadGenerator
from kvexp.metrics.records import RequestRecord
from kvexp.workload.prompts import exact_text, token_pool, token_prompts


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
