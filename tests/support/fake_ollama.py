"""A fake Ollama server for tests, written field by field from Ollama's documented API (docs/api.md,
docs/api/errors.mdx, docs/api/streaming.mdx) and its Go types (api/types.go; envconfig/config.go).

What it reproduces:
- `ollama serve` configuration from the environment: OLLAMA_HOST ([scheme://]host[:port], default
  127.0.0.1:11434), OLLAMA_NUM_PARALLEL (default 1), OLLAMA_MAX_QUEUE (default 512),
  OLLAMA_KV_CACHE_TYPE, OLLAMA_FLASH_ATTENTION (Go ParseBool; unparsable means true; unset means
  auto), OLLAMA_CONTEXT_LENGTH (per sequence; default 4096 here).
- GET / ("Ollama is running"), /api/version, /api/tags, /api/ps (name, model, size, digest, details,
  expires_at, size_vram, context_length); POST /api/generate and /api/chat, streaming NDJSON
  (application/x-ndjson, compact JSON, one object a line) or one object with stream=false.
- The final object: done, done_reason (stop | length), total_duration, load_duration,
  prompt_eval_count, prompt_eval_duration, eval_count, eval_duration in nanoseconds, each left out
  when zero (Go's omitempty); `context` for /api/generate without raw.
- Lazy model load on the first request (load_duration), a reload when options.num_ctx changes, an
  empty prompt / no messages loads the model (done_reason "load"). Requests beyond
  OLLAMA_NUM_PARALLEL wait for a slot before their first byte (the server writes its headers with the
  first line), beyond OLLAMA_MAX_QUEUE waiting they get 503.
- Errors: 404 {"error":"model 'x' not found"}; 400 for a bad body, raw with template/system/context,
  or (truncate=false) a prompt longer than the context; an error after the first line is a line
  {"error": "..."} and the stream ends (HTTP status stays 200).
- The log of current Ollama (which runs llama-server with -c num_ctx x N -np N): the "starting
  llama-server" command line and llama.cpp's `llama_kv_cache: size = ...` line (cells per stream,
  N/N seqs, the size of all streams); the quantised-KV-without-flash-attention warning of
  Ollama 0.20 (the KV type then falls back to f16, as Ollama's FAQ says).

Fake-only knobs (environment, FAKE_OLLAMA_*): MODELS (comma list, default tiny:latest), TTFT_S,
PROMPT_TOKEN_S, TOKEN_GAP_S, LOAD_S, STOP_AFTER (tokens before the model "emits EOS"; 0 = never),
VRAM (0 = everything on the CPU, size_vram 0), FAULT / FAULT_AFTER (default fault for every request).
A prompt containing `[[fake:KIND]]` or `[[fake:KIND@N]]` injects fault KIND after N tokens:
error (an error line), truncate (the connection drops mid-line), eof (the stream ends without its
final object), malformed (a broken JSON line), stall (no more bytes until the client leaves),
http500 (an HTTP 500 before any byte). GET /_fake/state shows what the fake received and did.

The fake's tokenizer is ceil(UTF-8 bytes / 4); chat adds 8 tokens of template per message, generate
without raw adds 4.

Run: python tests/support/fake_ollama.py serve"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, AsyncIterator, Optional, TextIO

from aiohttp import web

VERSION = "0.0.0-fake"
DEFAULT_PORT = 11434
QUANTISED = {"q8_0": 34 / 32, "q4_0": 18 / 32}
BYTES_PER_ELEMENT = {"f16": 2.0, **QUANTISED}
# The fake model: kvexp's tiny GGUF (2 layers, 2 KV heads x head_dim 32 = 64 K and 64 V elements per
# token per layer).
N_LAYERS, N_EMBD_KV = 2, 64
WEIGHTS_BYTES = 64 << 20
COMPUTE_BYTES = 8 << 20
MIB = 1 << 20
GENERATE_TEMPLATE_TOKENS = 4
CHAT_TEMPLATE_TOKENS = 8
WORDS = [" The", " sky", " is", " blue", " because", " of", " Rayleigh", " scattering", ",", " which",
         " affects", " short", " wavelengths", " more", " than", " long", " ones", "."]
FAULT_MARK = re.compile(r"\[\[fake:(\w+)(?:@(\d+))?\]\]")
FAULTS = ("error", "truncate", "eof", "malformed", "stall", "http500")
ERROR_MID_STREAM = "an error was encountered while running the model"


def parse_bool(value: Optional[str]) -> Optional[bool]:
    """envconfig.BoolWithDefault: unset -> None; Go's ParseBool; anything unparsable -> true."""
    if value is None or value == "":
        return None
    if value in ("1", "t", "T", "TRUE", "true", "True"):
        return True
    if value in ("0", "f", "F", "FALSE", "false", "False"):
        return False
    return True


def parse_uint(value: Optional[str], default: int) -> int:
    if value is None or value == "":
        return default
    try:
        n = int(value)
    except ValueError:
        return default
    return n if n >= 0 else default


def parse_host(value: Optional[str]) -> tuple[str, int]:
    """envconfig.Host: [scheme://]host[:port]; the port defaults to 11434."""
    s = (value or "").strip()
    if "://" in s:
        scheme, s = s.split("://", 1)
        default = {"http": 80, "https": 443}.get(scheme, DEFAULT_PORT)
    else:
        default = DEFAULT_PORT
    s = s.split("/", 1)[0]
    m = re.fullmatch(r"\[([^\]]+)\]:(\d+)|([^:\[\]]+):(\d+)", s)
    if m:
        host = m.group(1) or m.group(3)
        port = int(m.group(2) or m.group(4))
        return host, port if 0 <= port <= 65535 else default
    return (s.strip("[]") or "127.0.0.1"), default


def count_tokens(text: str) -> int:
    return max(1, math.ceil(len(text.encode()) / 4)) if text else 0


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def full_name(tag: str) -> str:
    return tag if ":" in tag else f"{tag}:latest"


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    num_parallel: int = 1
    max_queue: int = 512
    kv_cache_type: str = ""  # as given (lower-cased); "" = the default
    flash_attention: Optional[bool] = None  # None: not set (auto)
    context_length: int = 4096
    models: tuple[str, ...] = ("tiny:latest",)
    ttft_s: float = 0.05
    prompt_token_s: float = 0.0
    token_gap_s: float = 0.01
    load_s: float = 0.0
    stop_after: int = 0
    vram: bool = True
    fault: str = ""
    fault_after: int = 2
    env: dict[str, str] = field(default_factory=dict)  # the OLLAMA_* variables as received

    @classmethod
    def from_env(cls, environ: Optional[dict[str, str]] = None) -> "Settings":
        e = dict(os.environ if environ is None else environ)
        host, port = parse_host(e.get("OLLAMA_HOST"))
        f = lambda k, d: float(e.get(f"FAKE_OLLAMA_{k}") or d)  # noqa: E731
        models = tuple(full_name(m.strip()) for m in (e.get("FAKE_OLLAMA_MODELS") or "tiny:latest").split(",")
                       if m.strip())
        return cls(
            host=host, port=port,
            num_parallel=max(1, parse_uint(e.get("OLLAMA_NUM_PARALLEL"), 1)),
            max_queue=parse_uint(e.get("OLLAMA_MAX_QUEUE"), 512),
            kv_cache_type=(e.get("OLLAMA_KV_CACHE_TYPE") or "").strip().lower(),
            flash_attention=parse_bool(e.get("OLLAMA_FLASH_ATTENTION")),
            context_length=parse_uint(e.get("OLLAMA_CONTEXT_LENGTH"), 0) or 4096,
            models=models,
            ttft_s=f("TTFT_S", 0.05), prompt_token_s=f("PROMPT_TOKEN_S", 0.0),
            token_gap_s=f("TOKEN_GAP_S", 0.01), load_s=f("LOAD_S", 0.0),
            stop_after=int(f("STOP_AFTER", 0)), vram=e.get("FAKE_OLLAMA_VRAM", "1") != "0",
            fault=e.get("FAKE_OLLAMA_FAULT", ""), fault_after=int(f("FAULT_AFTER", 2)),
            env={k: v for k, v in e.items() if k.startswith("OLLAMA_")},
        )


@dataclass
class Runner:
    """One loaded model (the llama-server Ollama would run for it)."""

    model: str
    num_ctx: int  # per sequence
    num_parallel: int
    kv_type: str  # what the runner actually uses
    sem: asyncio.Semaphore
    waiting: int = 0
    in_flight: int = 0
    expires_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))

    @property
    def kv_bytes(self) -> int:
        cells = self.num_ctx * self.num_parallel
        return round(cells * N_LAYERS * N_EMBD_KV * 2 * BYTES_PER_ELEMENT[self.kv_type])

    @property
    def size(self) -> int:
        return WEIGHTS_BYTES + self.kv_bytes + COMPUTE_BYTES


class FakeOllama:
    def __init__(self, settings: Settings, log: Optional[TextIO] = None):
        self.s = settings
        self.log = log or sys.stderr
        self.runner: Optional[Runner] = None
        self.load_lock = asyncio.Lock()
        self.state: dict[str, Any] = {"requests": 0, "max_in_flight": 0, "loads": 0, "last_request": None,
                                      "rejected_busy": 0}

    # -- what the server decides from its environment -------------------------------------------
    @property
    def flash_attention(self) -> str:
        fa = self.s.flash_attention
        return "auto" if fa is None else ("on" if fa else "off")

    def effective_kv_type(self, warn: bool = False) -> str:
        kv = self.s.kv_cache_type
        if not kv:
            return "f16"
        if kv not in BYTES_PER_ELEMENT:
            if warn:
                self.slog("WARN", "server.go:239", "unsupported OLLAMA_KV_CACHE_TYPE", type=kv)
            return "f16"
        if kv in QUANTISED and self.s.flash_attention is not True:
            if warn:
                self.slog("WARN", "server.go:228",
                          "OLLAMA_FLASH_ATTENTION must be enabled to use a quantized OLLAMA_KV_CACHE_TYPE", type=kv)
            return "f16"
        return kv

    # -- logging in Ollama's slog text format and llama.cpp's ------------------------------------
    def slog(self, level: str, source: str, msg: str, **attrs: Any) -> None:
        parts = [f"time={now_rfc3339()}", f"level={level}", f"source={source}", f"msg={json.dumps(msg)}"]
        for k, v in attrs.items():
            v = str(v)
            parts.append(f"{k}={json.dumps(v) if (' ' in v or '=' in v or not v) else v}")
        self.raw_log(" ".join(parts))

    def raw_log(self, line: str) -> None:
        self.log.write(line + "\n")
        self.log.flush()

    def log_startup(self) -> None:
        env = " ".join(f"{k}:{v}" for k, v in sorted(self.s.env.items()))
        self.slog("INFO", "routes.go:1620", "server config", env=f"map[{env}]")
        self.slog("INFO", "routes.go:1700", f"Listening on {self.s.host}:{self.s.port} (version {VERSION})")

    async def load(self, model: str, num_ctx: int) -> Runner:
        kv = self.effective_kv_type(warn=True)
        args = ["llama-server", "--model", f"/models/blobs/sha256-{model.replace(':', '-')}", "--port", "40000",
                "--host", "127.0.0.1", "--no-webui", "--offline", "-c", str(num_ctx * self.s.num_parallel),
                "-np", str(self.s.num_parallel), "--log-verbosity", "4", "--no-log-prefix", "--no-log-timestamps"]
        if self.s.kv_cache_type and kv == self.s.kv_cache_type:  # passed only when applied
            args += ["--cache-type-k", kv, "--cache-type-v", kv]
        args += ["--flash-attn", self.flash_attention]
        self.slog("INFO", "llama_server.go:433", "starting llama-server", cmd=" ".join(args))
        if self.s.load_s:
            await asyncio.sleep(self.s.load_s)
        r = Runner(model, num_ctx, self.s.num_parallel, kv, asyncio.Semaphore(self.s.num_parallel))
        half = r.kv_bytes / 2 / MIB
        cells = num_ctx  # llama.cpp prints the cells per stream; -np N gives N streams
        loc = "CUDA0" if self.s.vram else "CPU"
        self.raw_log(f"llama_kv_cache: {loc:>10} KV buffer size = {r.kv_bytes / MIB:8.2f} MiB")
        self.raw_log(f"llama_kv_cache: size = {r.kv_bytes / MIB:7.2f} MiB ({cells:6d} cells, {N_LAYERS:3d} layers, "
                     f"{self.s.num_parallel:2d}/{self.s.num_parallel} seqs), K ({kv}): {half:7.2f} MiB, "
                     f"V ({kv}): {half:7.2f} MiB")
        self.slog("INFO", "server.go:1288", "llama runner started", duration=f"{self.s.load_s}s")
        self.state["loads"] += 1
        return r

    async def schedule(self, model: str, options: dict[str, Any]) -> tuple[Runner, int]:
        """The runner for this request, (re)loading it when needed; returns it and load_duration (ns)."""
        t0 = time.perf_counter_ns()
        num_ctx = int(options.get("num_ctx") or 0) or self.s.context_length
        async with self.load_lock:
            r = self.runner
            if r is None or r.model != model or r.num_ctx != num_ctx:
                if r is not None:
                    self.slog("INFO", "sched.go:600", "reloading runner", model=model, num_ctx=num_ctx)
                self.runner = r = await self.load(model, num_ctx)
        r.expires_at = datetime.now(timezone.utc) + timedelta(minutes=5)
        return r, max(1, time.perf_counter_ns() - t0)

    # -- HTTP -------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/", self.root)
        app.router.add_get("/api/version", self.version)
        app.router.add_get("/api/tags", self.tags)
        app.router.add_get("/api/ps", self.ps)
        app.router.add_post("/api/generate", self.generate)
        app.router.add_post("/api/chat", self.chat)
        app.router.add_get("/_fake/state", self.fake_state)
        return app

    async def root(self, request: web.Request) -> web.Response:
        return web.Response(text="Ollama is running")

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    def details(self) -> dict[str, Any]:
        return {"parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"],
                "parameter_size": "1M", "quantization_level": "F16"}

    async def tags(self, request: web.Request) -> web.Response:
        models = [{"name": m, "model": m, "modified_at": now_rfc3339(), "size": WEIGHTS_BYTES,
                   "digest": hashlib.sha256(m.encode()).hexdigest(), "details": self.details()} for m in self.s.models]
        return web.json_response({"models": models})

    async def ps(self, request: web.Request) -> web.Response:
        models = []
        r = self.runner
        if r is not None:
            models.append({"name": r.model, "model": r.model, "size": r.size,
                           "digest": hashlib.sha256(r.model.encode()).hexdigest(), "details": self.details(),
                           "expires_at": r.expires_at.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
                           "size_vram": r.size if self.s.vram else 0, "context_length": r.num_ctx})
        return web.json_response({"models": models})

    async def fake_state(self, request: web.Request) -> web.Response:
        r = self.runner
        return web.json_response({
            **self.state, "settings": asdict(self.s), "env": self.s.env,
            "effective": {"kv_cache_type": self.effective_kv_type(), "flash_attention": self.flash_attention,
                          "num_parallel": self.s.num_parallel, "context_length": self.s.context_length},
            "runner": None if r is None else {"model": r.model, "num_ctx": r.num_ctx, "kv_type": r.kv_type,
                                              "waiting": r.waiting, "in_flight": r.in_flight},
        })

    @staticmethod
    def error(status: int, msg: str) -> web.Response:
        return web.json_response({"error": msg}, status=status)

    async def read_body(self, request: web.Request) -> dict[str, Any] | web.Response:
        raw = await request.read()
        if not raw:
            return self.error(400, "missing request body")
        try:
            body = json.loads(raw)
        except ValueError as e:
            return self.error(400, f"invalid character in request body: {e}")
        if not isinstance(body, dict):
            return self.error(400, "json: cannot unmarshal into Go value of type api.GenerateRequest")
        self.state["requests"] += 1
        self.state["last_request"] = {"path": request.path, "body": body}
        return body

    def known(self, model: Any) -> Optional[str]:
        if not isinstance(model, str) or not model:
            return None
        name = full_name(model)
        return name if name in self.s.models else None

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await self.read_body(request)
        if isinstance(body, web.Response):
            return body
        model = self.known(body.get("model"))
        if model is None:
            return self.error(404, f"model '{body.get('model', '')}' not found")
        raw = bool(body.get("raw"))
        if raw and (body.get("template") or body.get("system") or body.get("context")):
            return self.error(400, "raw mode does not support template, system, or context")
        prompt = body.get("prompt") or ""
        runner, load_ns = await self.schedule(model, body.get("options") or {})
        if not prompt:
            return self.load_reply(model, body, "response")
        n_prompt = count_tokens(prompt) + (0 if raw else GENERATE_TEMPLATE_TOKENS)
        return await self.complete(request, body, "generate", model, runner, load_ns, n_prompt, prompt,
                                   with_context=not raw)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self.read_body(request)
        if isinstance(body, web.Response):
            return body
        model = self.known(body.get("model"))
        if model is None:
            return self.error(404, f"model '{body.get('model', '')}' not found")
        messages = body.get("messages") or []
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return self.error(400, "json: cannot unmarshal messages")
        runner, load_ns = await self.schedule(model, body.get("options") or {})
        if not messages:
            return self.load_reply(model, body, "message")
        text = " ".join(str(m.get("content") or "") for m in messages)
        n_prompt = sum(count_tokens(str(m.get("content") or "")) + CHAT_TEMPLATE_TOKENS for m in messages)
        return await self.complete(request, body, "chat", model, runner, load_ns, n_prompt, text)

    def load_reply(self, model: str, body: dict[str, Any], kind: str) -> web.Response:
        keep_alive = body.get("keep_alive")
        unload = keep_alive in (0, "0", "0s")
        if unload:
            self.runner = None
        out: dict[str, Any] = {"model": model, "created_at": now_rfc3339()}
        if kind == "response":
            out["response"] = ""
        else:
            out["message"] = {"role": "assistant", "content": ""}
        out.update(done=True, done_reason="unload" if unload else "load")
        return web.json_response(out)

    async def complete(self, request: web.Request, body: dict[str, Any], kind: str, model: str,
                       runner: Runner, load_ns: int, n_prompt: int, text: str,
                       with_context: bool = False) -> web.StreamResponse:
        t_start = time.perf_counter_ns() - load_ns
        options = body.get("options") or {}
        stream = body.get("stream") is not False
        truncate = body.get("truncate") is not False
        if n_prompt >= runner.num_ctx:
            if not truncate:
                return self.error(400, "the input length exceeds the context length")
            limit = max(1, runner.num_ctx // 2)
            self.slog("WARN", "llama_server.go:317", "truncating input prompt", limit=limit, prompt=n_prompt)
            n_prompt = limit
        fault, fault_after = self.s.fault, self.s.fault_after
        m = FAULT_MARK.search(text)
        if m:
            fault, fault_after = m.group(1), int(m.group(2) or self.s.fault_after)
        num_predict = int(options.get("num_predict") if options.get("num_predict") is not None else -1)
        room = runner.num_ctx - n_prompt
        n_out, reason = room, "length"
        if self.s.stop_after and self.s.stop_after < n_out:
            n_out, reason = self.s.stop_after, "stop"
        if num_predict >= 0 and num_predict <= n_out:
            n_out, reason = num_predict, "length"

        if runner.waiting >= self.s.max_queue:
            self.state["rejected_busy"] += 1
            return self.error(503, "server busy, please try again.  maximum pending requests exceeded")
        runner.waiting += 1
        try:
            await runner.sem.acquire()
        finally:
            runner.waiting -= 1
        runner.in_flight += 1
        self.state["max_in_flight"] = max(self.state["max_in_flight"], runner.in_flight)
        try:
            return await self._generate_tokens(request, kind, model, stream, n_prompt, n_out, reason,
                                               fault, fault_after, t_start, load_ns, with_context)
        finally:
            runner.in_flight -= 1
            runner.sem.release()

    def chunk(self, kind: str, model: str, piece: str) -> dict[str, Any]:
        out: dict[str, Any] = {"model": model, "created_at": now_rfc3339()}
        if kind == "generate":
            out["response"] = piece
        else:
            out["message"] = {"role": "assistant", "content": piece}
        out["done"] = False
        return out

    async def _generate_tokens(self, request: web.Request, kind: str, model: str, stream: bool,
                               n_prompt: int, n_out: int, reason: str, fault: str, fault_after: int,
                               t_start: int, load_ns: int, with_context: bool) -> web.StreamResponse:
        if fault == "http500" and fault_after == 0:
            return self.error(500, "llama runner process has terminated: exit status 2")
        t_prompt = time.perf_counter_ns()
        await asyncio.sleep(self.s.ttft_s + self.s.prompt_token_s * n_prompt)
        prompt_ns = time.perf_counter_ns() - t_prompt
        t_eval = time.perf_counter_ns()
        resp: Optional[web.StreamResponse] = None
        pieces: list[str] = []

        async def send(obj: dict[str, Any] | bytes) -> None:
            nonlocal resp
            if resp is None:
                resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
                await resp.prepare(request)
            data = obj if isinstance(obj, bytes) else json.dumps(obj, separators=(",", ":")).encode() + b"\n"
            await resp.write(data)

        try:
            for i in range(n_out):
                if i:
                    await asyncio.sleep(self.s.token_gap_s)
                if fault and i == fault_after:
                    if fault == "http500" and resp is None:
                        return self.error(500, "llama runner process has terminated: exit status 2")
                    if fault == "error" or fault == "http500":
                        if resp is None or not stream:  # before the first line: an HTTP status
                            return self.error(500, ERROR_MID_STREAM)
                        await send({"error": ERROR_MID_STREAM})
                        await resp.write_eof()
                        return resp
                    if fault == "truncate":
                        await send(b'{"model":"' + model.encode() + b'","created_at":"')
                        if request.transport is not None:
                            request.transport.abort()
                        return resp  # type: ignore[return-value]
                    if fault == "eof":
                        if resp is None:
                            await send(b"")
                        await resp.write_eof()  # type: ignore[union-attr]
                        return resp  # type: ignore[return-value]
                    if fault == "malformed":
                        await send(b'{"model":"' + model.encode() + b'","response":"tok\n')
                        await resp.write_eof()  # type: ignore[union-attr]
                        return resp  # type: ignore[return-value]
                    if fault == "stall":
                        if resp is None:
                            await send(b"")
                        while request.transport is not None and not request.transport.is_closing():
                            await asyncio.sleep(0.02)
                        return resp  # type: ignore[return-value]
                piece = WORDS[i % len(WORDS)]
                pieces.append(piece)
                if stream:
                    await send(self.chunk(kind, model, piece))
            eval_ns = time.perf_counter_ns() - t_eval if n_out > 1 else 0
            final = self.chunk(kind, model, "" if stream else "".join(pieces))
            final["done"] = True
            final["done_reason"] = reason
            if with_context:
                final["context"] = list(range(n_prompt + n_out))
            metrics = {"total_duration": time.perf_counter_ns() - t_start, "load_duration": load_ns,
                       "prompt_eval_count": n_prompt, "prompt_eval_duration": prompt_ns,
                       "eval_count": n_out, "eval_duration": eval_ns}
            final.update({k: v for k, v in metrics.items() if v})  # omitempty
            if not stream:
                return web.json_response(final)
            await send(final)
            await resp.write_eof()  # type: ignore[union-attr]
            return resp  # type: ignore[return-value]
        except (ConnectionResetError, ConnectionError):
            return resp or web.Response(status=499)


@contextlib.asynccontextmanager
async def running(settings: Optional[Settings] = None, log: Optional[TextIO] = None
                  ) -> AsyncIterator[tuple[str, FakeOllama]]:
    """Run the fake in this event loop on a free port; yields (base_url, fake)."""
    s = settings or Settings()
    fake = FakeOllama(s, log)
    runner = web.AppRunner(fake.app(), handle_signals=False, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, s.host, 0)
    await site.start()
    port = runner.addresses[0][1]
    s.port = port
    fake.log_startup()
    try:
        yield f"http://{s.host}:{port}", fake
    finally:
        await runner.cleanup()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="fake_ollama", description="A fake `ollama serve` for kvexp's tests.")
    ap.add_argument("command", choices=["serve", "--version", "-v"])
    args, _extra = ap.parse_known_args(argv)
    if args.command in ("--version", "-v"):
        print(f"ollama version is {VERSION}")
        return 0
    settings = Settings.from_env()
    fake = FakeOllama(settings)

    async def on_startup(app: web.Application) -> None:
        fake.log_startup()

    app = fake.app()
    app.on_startup.append(on_startup)
    web.run_app(app, host=settings.host, port=settings.port, print=None, shutdown_timeout=0.5,
                access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
