"""The Ollama adapter: the NDJSON parser on recorded lines in the documented format, the launch
environment per KV type, and the fake Ollama server (tests/support/fake_ollama.py) launched through
ServerProcess and driven by the load generator. Everything here is checked against Ollama's
documented protocol; no real Ollama runs in these tests."""

from __future__ import annotations

import asyncio
import io
import os
import stat
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvexp.backends.base import BackendError
from kvexp.backends.ollama import Ollama, OllamaConfig, models_dir, parse_ndjson_line
from kvexp.backends.ollamacache import parse_server_log
from kvexp.backends.process import ServerProcess, free_port
from kvexp.core.paths import cache_dir
from kvexp.core.config import ConfigError, ExperimentConfig, KVConfig, ModelConfig, ScenarioConfig
from kvexp.measure.client import make_session
from kvexp.measure.loadgen import LoadGenerator
from kvexp.metrics import stats
from kvexp.metrics.records import RequestRecord
from kvexp.workload.prompts import estimated_text

import fake_ollama  # noqa: E402

FAKE = Path(fake_ollama.__file__).resolve()
KVS = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


def make_cfg(kv: str = "q8_0", *, parallel: int | None = None, context: int | None = None,
             flash_attention: bool = True, env: dict[str, str] | None = None, concurrency=(1, 4),
             prompt_tokens: int = 32, max_tokens: int = 8, requests: int = 8, api: str = "completions",
             binary: str | None = None, tag: str | None = "tiny", gguf: str | None = None,
             endpoint: str | None = None) -> tuple[ExperimentConfig, Ollama]:
    cfg = ExperimentConfig(
        backend=OllamaConfig(parallel=parallel, context=context, flash_attention=flash_attention,
                             env=dict(env or {}), binary=binary, endpoint=endpoint),
        model=ModelConfig(name="tiny", ollama=tag, gguf=gguf),
        kv=KVConfig(name=kv, per_backend={"ollama": kv}),
        scenario=ScenarioConfig(name="t", prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                                concurrency=list(concurrency), requests=requests, api=api,
                                stall_timeout_s=5.0, request_timeout_s=20.0),
    )
    return cfg, Ollama(cfg, tag or gguf, binary)


# -- the parser, on lines written from docs/api.md, docs/api/streaming.mdx, docs/api/errors.mdx --

GENERATE_STREAM = [
    b'{"model":"llama3.2","created_at":"2023-08-04T08:52:19.385406455-07:00","response":"The","done":false}\n',
    b'{"model":"llama3.2","created_at":"2023-08-04T08:52:19.385406455-07:00","response":" sky","done":false}\n',
    b'{"model":"llama3.2","created_at":"2023-08-04T19:22:45.499127Z","response":"","done":true,'
    b'"done_reason":"stop","context":[1,2,3],"total_duration":10706818083,"load_duration":6338219291,'
    b'"prompt_eval_count":26,"prompt_eval_duration":130079000,"eval_count":259,"eval_duration":4232710000}\n',
]
CHAT_STREAM = [
    b'{"model":"llama3.2","created_at":"2023-08-04T08:52:19.385406455-07:00","message":{"role":"assistant",'
    b'"content":"The","images":null},"done":false}\n',
    b'{"model":"llama3.2","created_at":"2023-08-04T19:22:45.499127Z","message":{"role":"assistant","content":""},'
    b'"done_reason":"length","done":true,"total_duration":4883583458,"load_duration":1334875,'
    b'"prompt_eval_count":26,"prompt_eval_duration":342546000,"eval_count":282,"eval_duration":4535599000}\n',
]


def test_generate_stream_lines():
    first, second, final = (parse_ndjson_line(x) for x in GENERATE_STREAM)
    assert first.content and first.text == "The" and not first.done
    assert second.content and second.text == " sky"
    assert final.done and not final.content and final.error is None
    assert (final.prompt_tokens, final.output_tokens, final.finish_reason) == (26, 259, "stop")
    assert final.server_timings == pytest.approx({"total_s": 10.706818083, "load_s": 6.338219291,
                                                  "prompt_eval_s": 0.130079, "eval_s": 4.23271})


def test_chat_stream_lines():
    first, final = (parse_ndjson_line(x) for x in CHAT_STREAM)
    assert first.content and first.text == "The" and not first.done
    assert final.done and not final.content
    assert (final.prompt_tokens, final.output_tokens, final.finish_reason) == (26, 282, "length")
    assert final.server_timings["eval_s"] == pytest.approx(4.535599)


def test_final_object_may_carry_the_last_token():
    # docs/api/streaming.mdx: the done object carries the last piece of text
    ev = parse_ndjson_line(b'{"model":"gemma4","created_at":"2025-10-26T17:15:24.166576Z","response":"!",'
                           b'"done":true, "done_reason": "stop"}')
    assert ev.done and ev.content and ev.text == "!"
    assert ev.prompt_tokens is None and ev.output_tokens is None and ev.server_timings is None


def test_omitted_counts_are_unknown_not_zero():
    # Go omitempty drops zero values; servers before mid-2024 dropped prompt_eval_count on a cached prompt
    ev = parse_ndjson_line(b'{"model":"m","created_at":"2024-01-01T00:00:00Z","response":"","done":true,'
                           b'"done_reason":"length","total_duration":5000,"load_duration":100,"eval_count":1}')
    assert ev.done and ev.prompt_tokens is None and ev.output_tokens == 1
    assert set(ev.server_timings) == {"total_s", "load_s"}  # eval_duration 0 with one token: omitted


def test_thinking_counts_as_output():
    ev = parse_ndjson_line(b'{"model":"m","created_at":"t","message":{"role":"assistant","content":"",'
                           b'"thinking":"Hmm"},"done":false}')
    assert ev.content and ev.text == ""
    assert not parse_ndjson_line(b'{"model":"m","created_at":"t","response":"","done":false}').content


def test_error_malformed_and_blank_lines():
    ev = parse_ndjson_line(b'{"error":"an error was encountered while running the model"}\n')
    assert ev.error == "server: an error was encountered while running the model"
    assert parse_ndjson_line(b'{"model":"m","response":"tok\n').error.startswith("protocol: malformed JSON")
    assert parse_ndjson_line(b'[1, 2]').error.startswith("protocol:")
    assert parse_ndjson_line(b'{"model":"m","response":"x"}').error.startswith("protocol:")  # no done
    assert parse_ndjson_line(b'data: {"choices": []}').error.startswith("protocol: malformed JSON")  # SSE
    assert parse_ndjson_line(b"\n") is None and parse_ndjson_line(b"") is None


# -- configuration: launch argv and env, requests ------------------------------------------------

@pytest.mark.parametrize("kv", ["f16", "q8_0", "q4_0"])
def test_launch_env_per_kv_type(kv):
    cfg, b = make_cfg(kv, env={"OLLAMA_MODELS": "/models"}, binary="/opt/ollama")
    assert b.launch_argv(18080) == ["/opt/ollama", "serve"]
    env = b.launch_env(18080)
    assert env == {"OLLAMA_HOST": "127.0.0.1:18080", "OLLAMA_KV_CACHE_TYPE": kv, "OLLAMA_FLASH_ATTENTION": "1",
                   "OLLAMA_NUM_PARALLEL": "4", "OLLAMA_CONTEXT_LENGTH": str(2 * 32 + 8 + 64),
                   "OLLAMA_MODELS": "/models", "OLLAMA_NO_CLOUD": "1", "HOME": str(cache_dir() / "ollama" / "home")}
    assert b.name == "ollama" and b.capabilities.forces_output_length is False and b.capabilities.exact_prompts is False


def test_launch_defaults_and_overrides():
    _, b = make_cfg("f16", parallel=1, context=8192, flash_attention=False)
    assert b.launch_argv(0) == ["ollama", "serve"]
    env = b.launch_env(11500)
    assert env["OLLAMA_FLASH_ATTENTION"] == "0" and env["OLLAMA_NUM_PARALLEL"] == "1"
    assert env["OLLAMA_CONTEXT_LENGTH"] == "8192" and env["OLLAMA_HOST"] == "127.0.0.1:11500"
    assert "OLLAMA_HOST" not in make_cfg("f16")[1].launch_env(0)  # no port: the server's default


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_quantised_kv_needs_flash_attention(kv):
    with pytest.raises(ConfigError, match="backend.flash_attention=true") as e:
        make_cfg(kv, flash_attention=False)
    assert "\n" not in str(e.value)


def test_config_errors():
    with pytest.raises(ConfigError, match="backend.env.OLLAMA_KV_CACHE_TYPE: kvexp sets it from kv="):
        make_cfg(env={"OLLAMA_KV_CACHE_TYPE": "f16"})
    with pytest.raises(ConfigError, match="backend.parallel"):
        make_cfg(env={"OLLAMA_NUM_PARALLEL": "1"})
    with pytest.raises(ConfigError, match="model.ollama"):
        make_cfg(tag=None)
    with pytest.raises(ConfigError, match="model.ollama"):
        make_cfg(tag="@tiny")
    with pytest.raises(ConfigError, match="OLLAMA_KV_CACHE_TYPE accepts f16, q8_0, q4_0"):
        make_cfg("fp8")


def test_a_gguf_without_a_tag_is_imported_into_kvexps_models_folder(tmp_path):
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    _, b = make_cfg(tag=None, gguf=str(gguf))
    assert b.imports == gguf and b.model_tag == "kvexp-smollm2-135m-instruct.q4_1"
    assert b.launch_env(18080)["OLLAMA_MODELS"] == str(models_dir())
    assert b.request("hi", 4, "completions").body["model"] == b.model_tag
    _, own = make_cfg(tag=None, gguf=str(gguf), env={"OLLAMA_MODELS": "/models"})
    assert own.launch_env(18080)["OLLAMA_MODELS"] == "/models"  # the user's folder wins
    _, tagged = make_cfg(tag="qwen2.5:7b", gguf=str(gguf))  # a tag: served as pulled, the user's folder
    assert tagged.imports is None and tagged.model_tag == "qwen2.5:7b"
    # named, since HOME is kvexp's: the user's OLLAMA_MODELS, else the folder under the user's own home
    assert tagged.launch_env(1)["OLLAMA_MODELS"] == os.environ.get("OLLAMA_MODELS", str(Path.home() / ".ollama/models"))
    with pytest.raises(ConfigError, match="an attached Ollama server .* serves a tag it has"):
        make_cfg(tag=None, gguf=str(gguf), endpoint="http://127.0.0.1:11434")


def test_exact_text_only_for_a_gguf_kvexp_imports(tmp_path, monkeypatch):
    """A GGUF kvexp imports: the spec says offline_tokenizer (text units read with llama.cpp's tokenizer);
    a pulled tag: estimated text, and why; no llama-server: estimated text, and how to get exact prompts."""
    from kvexp.backends import gguf_tokenizer

    gguf = tmp_path / "m.gguf"
    _, imported = make_cfg(tag=None, gguf=str(gguf))
    _, tagged = make_cfg(tag="qwen2.5:7b")
    assert imported.spec.capabilities.offline_tokenizer and not tagged.spec.capabilities.offline_tokenizer
    why = asyncio.run(tagged.text_units(None, "completions", 0, tmp_path))  # type: ignore[arg-type]
    assert why == "model.ollama=qwen2.5:7b: a tag the server holds, whose vocabulary kvexp does not read"
    monkeypatch.setattr(gguf_tokenizer, "find_llama_server", lambda: None)
    why = asyncio.run(imported.text_units(None, "completions", 0, tmp_path))  # type: ignore[arg-type]
    assert isinstance(why, str) and "python -m kvexp install llamacpp" in why


def test_server_tpot_counts_intervals_not_tokens():
    """eval_duration runs from the first token to the last (Ollama's runners put the first token's decode
    in prompt_eval_duration): eval_count - 1 intervals, as the client's TPOT."""
    _, b = make_cfg()
    t = b.request_timing({"eval_s": 0.3, "prompt_eval_s": 0.05}, 4)
    assert t["tpot_s"] == pytest.approx(0.1) and t["prefill_s"] == 0.05
    assert b.request_timing({"eval_s": 0.0}, 1)["tpot_s"] is None


def test_requests():
    _, b = make_cfg(max_tokens=8)
    r = b.request("hello there", 8, "completions")
    assert r.path == "/api/generate"
    assert r.body == {"model": "tiny", "stream": True, "truncate": False, "prompt": "hello there", "raw": True,
                      "options": {"temperature": 0, "num_ctx": 136, "num_thread": b.threads, "num_predict": 8}}
    c = b.request("hello there", 8, "chat")
    assert c.path == "/api/chat" and "raw" not in c.body
    assert c.body["messages"] == [{"role": "user", "content": "hello there"}]
    with pytest.raises(BackendError, match="token-id prompts are not supported"):
        b.request([1, 2, 3], 8, "completions")
    with pytest.raises(NotImplementedError):
        asyncio.run(b.tokenize(None, "x"))  # type: ignore[arg-type]


# -- the KV cache as the server log states it ------------------------------------------------------

def test_kv_from_llama_server_log():
    log = ('time=2026-01-01T00:00:00.000Z level=INFO source=llama_server.go:433 msg="starting llama-server" '
           'cmd="/usr/lib/ollama/llama-server --model /m --port 40000 -c 32768 -np 4 --cache-type-k q8_0 '
           '--cache-type-v q8_0 --flash-attn on"\n'
           "llama_kv_cache:      CUDA0 KV buffer size =   952.00 MiB\n"
           "llama_kv_cache: size =  952.00 MiB (  8192 cells,  28 layers,  4/4 seqs), K (q8_0):  476.00 MiB, "
           "V (q8_0):  476.00 MiB\n")
    info = parse_server_log(log, "q8_0")  # num_ctx 8192 per sequence, 4 streams
    assert (info.dtype, info.capacity_tokens, info.seqs, info.bytes) == ("q8_0", 32768, 4, 952 << 20)
    assert "llama_kv_cache" in info.source[0]


def test_kv_from_command_line_only():
    log = ('time=t level=INFO source=llama_server.go:433 msg="starting llama-server" '
           'cmd="llama-server --model /m -c 4096 -np 1 --flash-attn auto"\n')
    info = parse_server_log(log, "f16")
    assert (info.dtype, info.capacity_tokens, info.seqs) == ("f16", 4096, 1)


def test_kv_from_older_runner_lines():
    log = ("llama_kv_cache_unified: kv_size = 8192, type_k = 'q4_0', type_v = 'q4_0', n_layer = 28, "
           "can_shift = 1, padding = 32\n"
           "llama_kv_cache_unified: KV self size  =  126.00 MiB, K (q4_0):   63.00 MiB, V (q4_0):   63.00 MiB\n")
    info = parse_server_log(log, "q4_0")
    assert (info.dtype, info.capacity_tokens, info.bytes) == ("q4_0", 8192, 126 << 20)


def test_kv_fallback_warning_means_f16():
    log = ('time=t level=WARN source=server.go:228 msg="OLLAMA_FLASH_ATTENTION must be enabled to use a '
           'quantized OLLAMA_KV_CACHE_TYPE" type=q8_0\n'
           'time=t level=INFO source=device.go:251 msg="kv cache" device=CUDA0 size="448.0 MiB"\n')
    info = parse_server_log(log, "q8_0")
    assert info.dtype == "f16" and "was not applied" in info.source[0]
    assert info.bytes == 448 << 20


def test_kv_not_reported():
    info = parse_server_log("time=t level=INFO msg=\"Listening on 127.0.0.1:11434 (version 0.5.1)\"\n", "q8_0")
    assert info.dtype is None and info.bytes is None
    assert info.source == ["requested via OLLAMA_KV_CACHE_TYPE=q8_0, not reported by the server "
                           "(no KV cache line in its log)"]


# -- the fake, launched as `ollama serve` through ServerProcess ----------------------------------------

def wrapper(tmp_path: Path) -> str:
    """An executable `ollama` that runs the fake, so that `[binary, "serve"]` starts it."""
    exe = tmp_path / "ollama"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(exe)


class Launched:
    def __init__(self, backend: Ollama, tmp_path: Path):
        self.backend = backend
        port = free_port()
        argv = backend.launch_argv(port)
        self.log = tmp_path / "server.log"
        self.proc = ServerProcess(argv, backend.launch_env(port), self.log, "ollama server")
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> "Launched":
        self.proc.start()
        self.proc.wait_ready(self.url + self.backend.health_path, 15)
        self.backend.base_url = self.url
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.stop(2)


async def drive(b: Ollama, session: aiohttp.ClientSession, concurrency: int, n: int, seed: int,
                api: str = "completions") -> list[RequestRecord]:
    s = b.cfg.scenario
    lg = LoadGenerator(session, b)
    reqs = [(b.request(p, s.max_tokens, api),
             RequestRecord(index=i, level=concurrency, target_prompt_tokens=s.prompt_tokens, max_tokens=s.max_tokens))
            for i, p in enumerate(estimated_text(n, s.prompt_tokens, seed))]
    return await lg.closed_loop(reqs, concurrency)


def fake_env(**kw: Any) -> dict[str, str]:
    env = {"FAKE_OLLAMA_TTFT_S": "0.1", "FAKE_OLLAMA_TOKEN_GAP_S": "0.01", "FAKE_OLLAMA_MODELS": "tiny"}
    env.update({f"FAKE_OLLAMA_{k.upper()}": str(v) for k, v in kw.items()})
    return env


def test_num_parallel_1_queues_requests(tmp_path):
    """OLLAMA_NUM_PARALLEL=1: four clients get no more throughput than one; TTFT at c=1 is the fake's."""
    env = fake_env()
    _, b = make_cfg("q8_0", parallel=1, env=env, binary=wrapper(tmp_path), max_tokens=8, requests=8)

    async def run() -> tuple[dict, dict, dict, list]:
        async with make_session(b.base_url, 8, 20, 5) as session:
            await b.preload(session)
            c1 = stats.summarize_level(await drive(b, session, 1, 8, seed=1))
            c4 = stats.summarize_level(await drive(b, session, 4, 8, seed=2))
            async with session.get("/_fake/state") as r:
                state = await r.json()
            return c1, c4, state, await b.loaded_models(session)

    with Launched(b, tmp_path):
        c1, c4, state, models = asyncio.run(run())
    for level in (c1, c4):
        assert level["errors"] == 0 and level["output_tokens"] == 64 and level["mean_output_tokens"] == 8
        assert level["mean_prompt_tokens"] >= 32  # realised from prompt_eval_count
    # c=1: the fake's own delay before the first token (a floor no busy machine lowers), and the first
    # token well before the last, which the fake sends 7 token gaps later
    ttft_ms, gap_ms = float(env["FAKE_OLLAMA_TTFT_S"]) * 1000, float(env["FAKE_OLLAMA_TOKEN_GAP_S"]) * 1000
    assert ttft_ms <= c1["ttft_p50_ms"] < c1["e2e_p50_ms"] - 7 * gap_ms / 2
    # one slot: four sent at once were served one at a time (the fake's own count, not a clock)
    assert c4["ttft_p50_ms"] > 2 * c1["ttft_p50_ms"]  # queued behind the one slot
    assert state["max_in_flight"] == 1 and state["loads"] == 1  # num_ctx matched: no reload
    assert state["effective"]["num_parallel"] == 1
    assert models[0]["name"] == "tiny:latest" and models[0]["size_vram"] == models[0]["size"] > 0


@pytest.mark.parametrize("kv", ["f16", "q8_0", "q4_0"])
def test_launch_env_reaches_the_server(tmp_path, kv):
    cfg, b = make_cfg(kv, env=fake_env(ttft_s=0.02), binary=wrapper(tmp_path), max_tokens=4)

    async def run() -> tuple[Any, ...]:
        async with make_session(b.base_url, 8, 20, 5) as session:
            version = await b.version(session)
            load_s = await b.preload(session)  # True: it loaded (the reply has no durations to time it by)
            kv_info = await b.kv_cache(session, (tmp_path / "server.log").read_text())
            records = await drive(b, session, 4, 4, seed=3, api="chat")
            async with session.get("/_fake/state") as r:
                state = await r.json()
            return version, load_s, kv_info, records, state, await b.loaded_models(session)

    with Launched(b, tmp_path):
        version, load_s, kv_info, records, state, models = asyncio.run(run())
    assert version == fake_ollama.VERSION and load_s is True
    assert state["env"]["OLLAMA_KV_CACHE_TYPE"] == kv and state["env"]["OLLAMA_FLASH_ATTENTION"] == "1"
    assert state["effective"] == {"kv_cache_type": kv, "flash_attention": "on", "num_parallel": 4,
                                  "context_length": b.context}
    assert state["max_in_flight"] == 4  # OLLAMA_NUM_PARALLEL=4 let four run at once
    assert kv_info.dtype == kv and kv_info.seqs == 4 and kv_info.capacity_tokens == 4 * b.context
    assert models[0]["context_length"] == b.context
    assert all(r.ok and r.output_tokens == 4 and r.finish_reason == "length" for r in records)
    assert state["last_request"]["path"] == "/api/chat"


def test_flash_attention_off_keeps_f16(tmp_path):
    _, b = make_cfg("f16", flash_attention=False, env=fake_env(), binary=wrapper(tmp_path))

    async def run() -> Any:
        async with make_session(b.base_url, 2, 20, 5) as session:
            await b.preload(session)
            return await b.kv_cache(session, (tmp_path / "server.log").read_text())

    with Launched(b, tmp_path):
        info = asyncio.run(run())
    assert info.dtype == "f16"


# -- faults, with the fake in this process ----------------------------------------------------------

async def one(b: Ollama, prompt: str, stall_s: float = 5.0, api: str = "completions") -> RequestRecord:
    s = b.cfg.scenario
    async with make_session(b.base_url, 2, 10, stall_s) as session:
        return await LoadGenerator(session, b).send(b.request(prompt, s.max_tokens, api),
                                                    RequestRecord(index=0, level=1))


async def with_fake(b: Ollama, coro_fn, **settings: Any) -> Any:
    log = io.StringIO()
    s = fake_ollama.Settings(ttft_s=0.01, token_gap_s=0.005, num_parallel=2, **settings)
    async with fake_ollama.running(s, log) as (url, fake):
        b.base_url = url
        return await coro_fn(), log.getvalue()


@pytest.mark.parametrize("fault,kind,message", [
    ("error", "protocol", "server: an error was encountered while running the model"),
    ("truncate", "protocol", "truncated or malformed response"),
    ("eof", "protocol", "stream ended before its final event"),
    ("malformed", "protocol", "protocol: malformed JSON"),
    ("stall", "timeout", "no response bytes"),
    ("http500@0", "http_status", "HTTP 500"),
])
def test_faults_are_classified(fault, kind, message):
    _, b = make_cfg(max_tokens=8)
    rec, _ = asyncio.run(with_fake(b, lambda: one(b, f"hello [[fake:{fault}]] world", stall_s=0.3),
                                   kv_cache_type="f16"))
    assert rec.error_kind == kind and message in rec.error
    if fault in ("error", "truncate", "malformed", "stall"):
        assert len(rec.token_times_s) == 2  # the fault came after two tokens


def test_http_errors():
    _, b = make_cfg(max_tokens=8, tag="missing")
    rec, _ = asyncio.run(with_fake(b, lambda: one(b, "hi")))
    assert rec.error_kind == "http_status" and rec.http_status == 404
    assert "model 'missing' not found" in rec.error
    # truncate=false: a prompt longer than the context is an error, not silently cut
    _, b = make_cfg(max_tokens=8, context=16)
    rec, _ = asyncio.run(with_fake(b, lambda: one(b, "x" * 400)))
    assert rec.http_status == 400 and "exceeds the context length" in rec.error


def test_preload_unknown_model_is_one_clear_error():
    _, b = make_cfg(tag="nope:7b")

    async def go() -> None:
        async with make_session(b.base_url, 2, 10, 5) as session:
            await b.preload(session)

    with pytest.raises(BackendError, match=r"model 'nope:7b' not found \(pull it first: ollama pull nope:7b\)"):
        asyncio.run(with_fake(b, go))


def test_variable_length_output():
    """num_predict only caps: a model that stops early yields fewer tokens, done_reason stop."""
    _, b = make_cfg(max_tokens=8)
    rec, _ = asyncio.run(with_fake(b, lambda: one(b, "hello", api="chat"), stop_after=3))
    assert rec.ok and rec.output_tokens == 3 and rec.finish_reason == "stop" and len(rec.token_times_s) == 3
    assert rec.prompt_tokens == 2 + fake_ollama.CHAT_TEMPLATE_TOKENS
    assert set(rec.server_timings) == {"total_s", "load_s", "prompt_eval_s", "eval_s"}


def test_poll_exposes_nothing():
    _, b = make_cfg()
    sample = asyncio.run(b.poll(None))  # type: ignore[arg-type]
    assert (sample.kv_usage, sample.running, sample.waiting, sample.preemptions_total) == (None,) * 4


def test_fake_reads_ollama_env_like_ollama():
    s = fake_ollama.Settings.from_env({"OLLAMA_HOST": "http://0.0.0.0:9999", "OLLAMA_FLASH_ATTENTION": "yes",
                                       "OLLAMA_NUM_PARALLEL": "0", "OLLAMA_KV_CACHE_TYPE": "Q8_0"})
    assert (s.host, s.port, s.flash_attention, s.num_parallel, s.kv_cache_type) == ("0.0.0.0", 9999, True, 1, "q8_0")
    assert fake_ollama.parse_host("") == ("127.0.0.1", 11434)
    assert fake_ollama.parse_host("[::1]:8080") == ("::1", 8080)
    assert fake_ollama.parse_bool("false") is False and fake_ollama.parse_bool(None) is None
    assert os.access(FAKE, os.R_OK)


def test_a_runner_lost_mid_level_is_read_from_the_servers_own_lines():
    """Lines Ollama 0.24.0 wrote when its runner was killed mid-level (kill -9) and it loaded the model
    again; a level's log without them loses nothing."""
    _, b = make_cfg("f16")
    gone = ('time=2026-12-07T12:52:43.855Z level=WARN source=server.go:1305 msg="llama runner process no longer '
            'running" sys=9 string="signal: killed"\n')
    again = ('time=2026-12-07T12:52:43.867Z level=INFO source=server.go:433 msg="starting runner" '
             'cmd="/root/.cache/kvexp/bin/ollama-0.24.0-b1 runner --model /m/blobs/sha256-2dfa --port 43849"\n')
    assert b.model_lost(gone + again) == ('Ollama\'s runner died ("llama runner process no longer running", '
                                          'signal: killed) and the model was loaded again')
    assert b.model_lost(again) == "Ollama started its model runner again: the model was loaded again"
    assert b.model_lost('time=... level=INFO source=routes.go:1 msg="request" status=200\n') is None
