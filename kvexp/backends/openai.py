"""OpenAI-compatible streaming (SSE), shared by vLLM and llama.cpp.

A chunk is a token arrival when it has a choice that is not the role-only opening chunk and either
carries text or is an empty-text chunk that does not finish the stream (vLLM sends those when a token's
text is still incomplete UTF-8). Token counts come from the final `usage` chunk, never from counting
chunks.

parse_sse_line is on the load generator's hot path (once per token): it decodes JSON with orjson
when installed (falling back to json for anything orjson refuses, so results are json's), and hands
back one shared, immutable event per token text for plain token chunks."""

from __future__ import annotations

import json
from typing import Any, Optional

from kvexp.backends.base import Request, StreamEvent

try:
    import orjson

    def _fast_loads(payload: bytes) -> Any:
        if payload.count(b"{") + payload.count(b"[") > 900:  # json's recursion limit decides deep nests
            return json.loads(payload)
        try:
            return orjson.loads(payload)
        except ValueError:  # NaN, lone surrogates, non-UTF-8 and the like: json decides
            return json.loads(payload)
except ImportError:  # pragma: no cover - orjson is optional (the `fast` extra)
    _fast_loads = json.loads

# llama-server's `timings` keys kept per request (ms become seconds): prefill and decode durations,
# the server's TPOT (predicted_ms / (predicted_n - 1)), and its token counts (cache_n: prompt tokens
# reused from the slot's cache).
_TIMINGS = ("prompt_ms", "predicted_ms", "predicted_per_token_ms", "prompt_n", "predicted_n", "cache_n")
_TOKEN_EVENTS: dict[str, StreamEvent] = {}  # plain token events by text (events are frozen)
_TOKEN_EVENTS_MAX = 1 << 16


def chat_messages(prompt: Any) -> list[dict[str, str]]:
    """A chat request's messages: a text is one user message; messages are sent as they are."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        return prompt
    raise ValueError("the chat API takes a text prompt or chat messages")


def completion_request(model: str, prompt: Any, max_tokens: int, api: str,
                       extra: dict[str, Any]) -> Request:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        **extra,
    }
    if api == "chat":
        body["messages"] = chat_messages(prompt)
        return Request("/v1/chat/completions", body)
    body["prompt"] = prompt
    return Request("/v1/completions", body)


def parse_sse_line(line: bytes) -> Optional[StreamEvent]:
    line = line.strip()
    if not line or line.startswith(b":"):
        return None
    if not line.startswith(b"data:"):
        if line.startswith((b"event:", b"id:", b"retry:")):
            return None
        return StreamEvent(error=f"protocol: not an SSE data line: {line[:80]!r}")
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return StreamEvent(done=True)
    try:
        data = _fast_loads(payload)
    except ValueError:
        return StreamEvent(error=f"protocol: malformed JSON in stream: {payload[:80]!r}")
    ev = _event(data)
    if _fast_loads is not json.loads and (ev.error is not None or float in (
            type(ev.prompt_tokens), type(ev.output_tokens), type(ev.finish_reason))):
        ev = _event(json.loads(payload))  # orjson reads integers beyond 64 bits as floats: json's reading
    return ev


def _event(data: Any) -> StreamEvent:
    if not isinstance(data, dict):
        return StreamEvent(error="protocol: stream chunk is not a JSON object")
    if "error" in data:
        err = data["error"]
        msg = err.get("message") if isinstance(err, dict) else err
        return StreamEvent(error=f"server: {msg}")
    content, text, finish = False, "", None
    choices = data.get("choices") or []
    if choices:
        c = choices[0]
        finish = c.get("finish_reason")
        if "delta" in c:
            delta = c.get("delta") or {}
            piece = delta.get("content")
            role_only = "role" in delta
        else:
            piece = c.get("text")
            role_only = False
        if isinstance(piece, str) and not role_only:
            text = piece
            content = bool(piece) or finish is None
    usage = data.get("usage") or {}
    timings = data.get("timings")
    server_timings = None
    if isinstance(timings, dict):  # llama-server's own timing of the request (ms and token counts)
        server_timings = {
            (k[:-3] + "_s" if k.endswith("_ms") else k): (float(v) / 1000.0 if k.endswith("_ms") else float(v))
            for k, v in timings.items() if k in _TIMINGS and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
    prompt_tokens, output_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if content and finish is None and server_timings is None and prompt_tokens is None and output_tokens is None:
        ev = _TOKEN_EVENTS.get(text)
        if ev is None:
            if len(_TOKEN_EVENTS) >= _TOKEN_EVENTS_MAX:
                _TOKEN_EVENTS.clear()
            ev = _TOKEN_EVENTS[text] = StreamEvent(content=True, text=text)
        return ev
    return StreamEvent(
        content=content, text=text, finish_reason=finish,
        prompt_tokens=prompt_tokens, output_tokens=output_tokens,
        server_timings=server_timings,
    )
