"""A fault-injecting stand-in for llama-server, for tests: the endpoints kvexp's llama.cpp adapter uses,
framed as llama-server frames them (tests/fixtures/llamacpp/ and the reference captures).

What it reproduces:
- llama-server's command line (-m, --alias, --host, --port, -np, -c, -ctk, -ctv, --api-key; other
  flags are accepted and ignored), so kvexp launches it through `backend.binary` (a wrapper script
  that runs this file) exactly as it launches llama-server.
- The startup log: the `llama_kv_cache: size = ...` line with the asked K and V types (the runner
  checks it), the listening line, and one line per request.
- GET /health (503 "Loading model" until ready), /props (build_info), /v1/models, /slots
  (is_processing, n_prompt_tokens, next_token[].n_decoded), /metrics (Prometheus text);
  POST /tokenize (one token per UTF-8 byte, BOS 1 with add_special), /apply-template, and streamed
  /v1/completions and /v1/chat/completions: one `data: {json}` line a token, a final chunk with
  finish_reason "length", `usage` and `timings`, then `data: [DONE]`; the connection is closed
  after every streamed response. Requests beyond -np slots wait for a slot.
- --api-key: every endpoint but /health and /v1/models answers 401 without `Authorization: Bearer KEY`.

Faults (fake-only flags): --fault KIND applies to the completion requests numbered after
--fault-after N (counting from 1, warm-up included), every --fault-every K-th of them:
  crash      one token, then the process kills itself with SIGKILL (an OOM kill mid-level)
  stall      one token, then no more bytes until the client leaves
  http500    HTTP 500 with llama-server's JSON error body; http429 the same with 429
  reset      the connection is reset (RST) before any response byte
  malformed  one token, then a line of broken JSON, then the rest of the stream
  truncate   one token, then half a line, then the connection drops
  burst      the tokens are generated at --token-gap as usual but sent in one write at the end (a
             server that buffers its stream: the client sees every token arrive at once)
  wedge      from this request on the engine is deadlocked (llama-server's own SIGTERM handler can do
             that): /health still answers, /slots never does, and each completion request gets its
             headers and, a second later, an empty end of stream (its HTTP thread giving up)
  never_ready  /health answers 503 for ever (not per request)
--start-delay S: /health answers 503 for S seconds first. --token-gap S: time between tokens.
SIGTERM or SIGINT: exit at once (status 0).

Run: python tests/support/fake_openai.py --port 8080 [--fault KIND ...]; for kvexp to launch it,
backend.binary=<wrapper(folder)> and the fault flags in backend.extra_args=[--fault,KIND,...]."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any, Optional

from aiohttp import web

BUILD = "b0-fake"
FAULTS = ("crash", "stall", "http500", "http429", "reset", "malformed", "truncate", "burst", "wedge", "never_ready")


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="fake_openai", allow_abbrev=False)
    ap.add_argument("-m", "--model", default="models/fake.gguf")
    ap.add_argument("--alias", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("-np", "--parallel", type=int, default=1)
    ap.add_argument("-c", "--ctx-size", type=int, default=4096)
    ap.add_argument("-ctk", "--cache-type-k", default="f16")
    ap.add_argument("-ctv", "--cache-type-v", default="f16")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--fault", choices=FAULTS, default=None)
    ap.add_argument("--fault-after", type=int, default=0)
    ap.add_argument("--fault-every", type=int, default=1)
    ap.add_argument("--start-delay", type=float, default=0.0)
    ap.add_argument("--token-gap", type=float, default=0.001)
    args, _ignored = ap.parse_known_args(argv)
    return args


def log(msg: str) -> None:
    print(msg, flush=True)


class Fake:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.model = args.alias or args.model
        self.started = time.monotonic()
        self.count = 0  # completion requests received
        self.slots: list[Optional[dict[str, Any]]] = [None] * args.parallel
        self.free = asyncio.Semaphore(args.parallel)
        self.deferred = 0
        self.prompt_total = 0
        self.predicted_total = 0
        self.wedged = False  # fault wedge: the engine no longer answers

    # ------------------------------------------------------------ helpers
    def faulty(self, n: int) -> Optional[str]:
        a = self.args
        if a.fault in (None, "never_ready") or n <= a.fault_after:
            return None
        return a.fault if (n - a.fault_after - 1) % max(1, a.fault_every) == 0 else None

    @staticmethod
    def error(status: int, message: str, kind: str) -> web.Response:
        return web.json_response({"error": {"code": status, "message": message, "type": kind}}, status=status)

    @staticmethod
    def tokens(text: str, add_special: bool) -> list[int]:
        return ([1] if add_special else []) + [b + 100 for b in text.encode()]

    def chunk(self, chat: bool, text: Optional[str], finish: Optional[str] = None,
              extra: Optional[dict[str, Any]] = None) -> bytes:
        if chat:
            delta = {} if text is None else {"content": text}
            choice = {"finish_reason": finish, "index": 0, "delta": delta}
            obj = "chat.completion.chunk"
        else:
            choice = {"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        data = {"choices": [choice], "created": int(time.time()), "model": self.model,
                "system_fingerprint": BUILD, "object": obj, "id": "chatcmpl-fake", **(extra or {})}
        return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"

    # ------------------------------------------------------------ middleware and endpoints
    @web.middleware
    async def guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        key = self.args.api_key
        if key and request.path not in ("/health", "/v1/models") and \
                request.headers.get("Authorization") != f"Bearer {key}":
            resp: web.StreamResponse = self.error(401, "Invalid API Key", "authentication_error")
        else:
            resp = await handler(request)
        log(f"srv  log_server_r: request: {request.method} {request.path} {request.remote} {resp.status}")
        return resp

    async def health(self, request: web.Request) -> web.Response:
        waiting = time.monotonic() - self.started < self.args.start_delay
        if self.args.fault == "never_ready" or waiting:
            return self.error(503, "Loading model", "unavailable_error")
        return web.json_response({"status": "ok"})

    async def props(self, request: web.Request) -> web.Response:
        return web.json_response({"build_info": BUILD, "model_path": self.args.model,
                                  "total_slots": self.args.parallel})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"tokens": self.tokens(body.get("content", ""), bool(body.get("add_special")))})

    async def apply_template(self, request: web.Request) -> web.Response:
        body = await request.json()
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in body.get("messages", []))
        return web.json_response({"prompt": text + "<|im_start|>assistant\n"})

    async def slots_view(self, request: web.Request) -> web.Response:
        if self.wedged:
            await asyncio.sleep(3600)
        n_ctx = self.args.ctx_size // self.args.parallel
        out = []
        for i, s in enumerate(self.slots):
            slot: dict[str, Any] = {"id": i, "n_ctx": n_ctx, "speculative": False, "is_processing": s is not None}
            if s is not None:
                slot.update(n_prompt_tokens=s["prompt"], next_token=[{"has_next_token": True, "n_decoded": s["decoded"]}])
            out.append(slot)
        return web.json_response(out)

    async def metrics(self, request: web.Request) -> web.Response:
        busy = sum(s is not None for s in self.slots)
        lines = [("prompt_tokens_total", "counter", self.prompt_total),
                 ("tokens_predicted_total", "counter", self.predicted_total),
                 ("requests_processing", "gauge", busy), ("requests_deferred", "gauge", self.deferred)]
        text = "".join(f"# TYPE llamacpp:{n} {t}\nllamacpp:{n} {v}\n" for n, t, v in lines)
        return web.Response(text=text, content_type="text/plain")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        body = await request.json()
        self.count += 1
        fault = self.faulty(self.count)
        if fault in ("http500", "http429"):
            status = int(fault[4:])
            return self.error(status, f"fake fault: HTTP {status}", "server_error" if status == 500 else "unavailable_error")
        if fault == "reset":
            log("fake: fault reset: resetting the connection")
            sock = request.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            request.transport.abort()
            return web.Response()
        self.wedged = self.wedged or fault == "wedge"
        if self.wedged:
            log("fake: wedged: no answer")
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Connection": "close"})
            await resp.prepare(request)
            await asyncio.sleep(1.0)
            await resp.write_eof()
            return resp
        if chat:
            text = "".join(m.get("content", "") for m in body.get("messages", []))
            n_prompt = len(self.tokens(text, True)) + 8
        else:
            prompt = body.get("prompt", "")
            n_prompt = len(prompt) if isinstance(prompt, list) else len(self.tokens(prompt, True))
        n_out = int(body.get("max_tokens") or 16)

        self.deferred += 1
        await self.free.acquire()
        self.deferred -= 1
        i = self.slots.index(None)
        slot = self.slots[i] = {"prompt": n_prompt, "decoded": 0}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Connection": "close"})
        try:
            await self.stream(request, resp, chat, fault, slot, n_prompt, n_out)
        except ConnectionError:
            log(f"srv  send: slot {i}: the client closed the connection")
        finally:
            self.slots[i] = None
            self.free.release()
        return resp

    async def stream(self, request: web.Request, resp: web.StreamResponse, chat: bool, fault: Optional[str],
                     slot: dict[str, int], n_prompt: int, n_out: int) -> None:
        await resp.prepare(request)
        t0 = time.perf_counter()
        if chat:
            await resp.write(b"data: " + json.dumps({"choices": [{"finish_reason": None, "index": 0, "delta": {
                "role": "assistant", "content": None}}], "object": "chat.completion.chunk"}).encode() + b"\n\n")
        held: list[bytes] = []  # fault burst: every token of the response, written at once at the end
        for k in range(n_out):
            await asyncio.sleep(self.args.token_gap)
            if fault == "burst":
                held.append(self.chunk(chat, "ab"[k % 2]))
            else:
                await resp.write(self.chunk(chat, "ab"[k % 2]))
            slot["decoded"] += 1
            self.predicted_total += 1
            if k == 0 and fault and fault != "burst" and await self.inject(fault, resp, request):
                return
        if held:
            await resp.write(b"".join(held))
        self.prompt_total += n_prompt
        ms = (time.perf_counter() - t0) * 1000
        usage = {"completion_tokens": n_out, "prompt_tokens": n_prompt, "total_tokens": n_prompt + n_out,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        timings = {"cache_n": 0, "prompt_n": n_prompt, "prompt_ms": 0.1, "predicted_n": n_out, "predicted_ms": ms,
                   "predicted_per_token_ms": ms / (n_out - 1) if n_out > 1 else None}
        if chat:
            await resp.write(self.chunk(chat, None, "length"))
            await resp.write(b"data: " + json.dumps({"choices": [], "object": "chat.completion.chunk",
                                                      "usage": usage, "timings": timings}).encode() + b"\n\n")
        else:
            await resp.write(self.chunk(chat, "", "length", {"usage": usage, "timings": timings}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()

    async def inject(self, fault: str, resp: web.StreamResponse, request: web.Request) -> bool:
        """Inject a fault after the first token; True when the stream must end there."""
        log(f"fake: fault {fault}")
        if fault == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault == "stall":
            await asyncio.sleep(3600)
        elif fault == "malformed":
            await resp.write(b'data: {"choices":[{"text":"x","index":0,\n\n')
        elif fault == "truncate":
            await resp.write(b'data: {"choices":[{"te')
            request.transport.abort()
            return True
        return False


async def serve(args: argparse.Namespace) -> None:
    fake = Fake(args)
    app = web.Application(middlewares=[fake.guard])
    app.router.add_get("/health", fake.health)
    app.router.add_get("/props", fake.props)
    app.router.add_get("/v1/models", fake.models)
    app.router.add_post("/tokenize", fake.tokenize)
    app.router.add_post("/apply-template", fake.apply_template)
    app.router.add_get("/slots", fake.slots_view)
    app.router.add_get("/metrics", fake.metrics)
    app.router.add_post("/v1/completions", fake.completions)
    app.router.add_post("/v1/chat/completions", fake.completions)
    cells = args.ctx_size // args.parallel
    log(f"build: 0 ({BUILD}) fake llama-server")
    log(f"llama_kv_cache: size =    0.25 MiB ({cells:6d} cells,   2 layers,  1/{args.parallel} seqs), "
        f"K ({args.cache_type_k}):    0.12 MiB, V ({args.cache_type_v}):    0.12 MiB")
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    log(f"srv  llama_server: listening on http://{args.host}:{args.port}")
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    log("srv    operator(): cleaning up before exit...")
    os._exit(0)  # at once, even with stalled handlers


def wrapper(folder: Path) -> Path:
    """An executable that runs this fake with the arguments it gets: a llama-server for `backend.binary=`."""
    path = folder / "fake-llama-server"
    path.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))} "$@"\n')
    path.chmod(0o755)
    return path


if __name__ == "__main__":
    asyncio.run(serve(parse_args(sys.argv[1:])))
