"""The small interface every backend adapter implements, and the data it hands back.

An adapter is mostly pure: the argv and environment to launch its server, the URL paths to probe,
the JSON body of a streaming request, how to parse one stream line, and how to read the server's own
telemetry. Timing is not the adapter's business: the load generator owns the clock."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import aiohttp


class BackendError(RuntimeError):
    """A backend did something kvexp cannot work with; the message is one line."""


@dataclass(frozen=True)
class StreamEvent:
    """What one line of a response stream says. Unknown is None."""

    content: bool = False  # carries generated output (counts for TTFT / ITL)
    text: str = ""
    done: bool = False  # the final event of the response
    prompt_tokens: Optional[int] = None
    output_tokens: Optional[int] = None
    finish_reason: Optional[str] = None
    server_timings: Optional[dict[str, float]] = None  # the server's own timings, seconds
    error: Optional[str] = None  # the stream reported an error


@dataclass
class KVCacheInfo:
    """The KV cache as the server itself reports it (None: not exposed)."""

    dtype: Optional[str] = None  # the backend's own spelling, e.g. f16, q8_0, auto, fp8
    dtype_k: Optional[str] = None
    dtype_v: Optional[str] = None
    blocks: Optional[int] = None
    block_size: Optional[int] = None
    capacity_tokens: Optional[int] = None  # cells (llama.cpp) or blocks x block_size (vLLM)
    bytes: Optional[int] = None
    gpu_memory_utilization: Optional[float] = None
    max_concurrency: Optional[float] = None  # as the server states it (vLLM's startup line)
    seqs: Optional[int] = None  # parallel sequences / slots
    source: list[str] = field(default_factory=list)  # where each figure came from


@dataclass
class TelemetrySample:
    """One poll of the server's own metrics (None: not exposed)."""

    kv_usage: Optional[float] = None  # 0..1
    running: Optional[int] = None
    waiting: Optional[int] = None
    preemptions_total: Optional[float] = None  # a counter; levels use the difference


@dataclass
class Request:
    path: str  # e.g. /v1/completions
    body: dict[str, Any]


class Backend(Protocol):
    name: str
    forces_output_length: bool  # False: output length can only be capped (Ollama)
    stream_keepalive: bool  # False: the server closes the connection after each streamed response

    # Launch (not called when attaching to an endpoint)
    def launch_argv(self, port: int) -> list[str]: ...
    def launch_env(self, port: int) -> dict[str, str]: ...
    health_path: str

    # Requests
    def request(self, prompt: str | list[int], max_tokens: int, api: str) -> Request: ...
    def parse_line(self, line: bytes) -> Optional[StreamEvent]: ...
    async def tokenize(self, session: aiohttp.ClientSession, text: str) -> list[int]: ...

    # Telemetry
    async def version(self, session: aiohttp.ClientSession) -> Optional[str]: ...
    async def kv_cache(self, session: aiohttp.ClientSession, log_text: str) -> KVCacheInfo: ...
    async def poll(self, session: aiohttp.ClientSession) -> TelemetrySample: ...
