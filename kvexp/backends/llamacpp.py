"""llama.cpp's llama-server: launch flags, requests, and the KV cache as the server states it.

The KV type and size are not in /props: the startup log states them at verbosity 4
(`llama_kv_cache: size = 1.06 MiB (1024 cells, 2 layers, 4/4 seqs), K (q8_0): 0.53 MiB, ...`).
/metrics has no KV-usage gauge in these builds, so usage is derived from /slots (tokens held by busy
slots over total slot context)."""

from __future__ import annotations

import os
import re
from typing import Any, Optional

import aiohttp

from kvexp.backends import openai
from kvexp.backends.base import BackendError, KVCacheInfo, Request, StreamEvent, TelemetrySample
from kvexp.backends.metrics import parse_metrics
from kvexp.config import ExperimentConfig, LlamaCppConfig, highest_concurrency

KV_LINE = re.compile(
    r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)/(\d+) seqs\),"
    r"\s*K \((\w+)\):\s*([\d.]+) MiB,\s*V \((\w+)\):\s*([\d.]+) MiB")
MIB = 1 << 20


def parse_kv_log(log_text: str) -> Optional[KVCacheInfo]:
    """The last llama_kv_cache size line of a llama-server log (the context's own cache).

    The line reads `(<cells> cells, <layers> layers, <seq_max>/<streams> seqs)`: the cells are per
    stream, and with -np N (no unified cache) every slot has a stream of its own, so the cache holds
    cells x streams tokens; the size in MiB is the total."""
    matches = KV_LINE.findall(log_text)
    if not matches:
        return None
    size, cells, _layers, seq_max, streams, k, _ks, v, _vs = matches[-1]
    return KVCacheInfo(
        dtype=k if k == v else f"{k}/{v}", dtype_k=k, dtype_v=v,
        capacity_tokens=int(cells) * int(streams), bytes=round(float(size) * MIB), seqs=int(seq_max),
        source=["server log: llama_kv_cache size line (cells x streams)"],
    )


def slots_usage(slots: list[dict[str, Any]]) -> Optional[float]:
    """Fraction of the slots' context held by busy slots (prompt + decoded tokens)."""
    total = sum(int(s.get("n_ctx") or 0) for s in slots)
    if total <= 0:
        return None
    used = 0
    for s in slots:
        if not s.get("is_processing"):
            continue
        decoded = sum(int(t.get("n_decoded") or 0) for t in s.get("next_token") or [])
        used += int(s.get("n_prompt_tokens") or 0) + decoded
    return min(1.0, used / total)


class LlamaCpp:
    name = "llamacpp"
    forces_output_length = True
    health_path = "/health"
    stream_keepalive = False  # the server closes the connection after each streamed response

    def __init__(self, cfg: ExperimentConfig, model_path: Optional[str], binary: Optional[str]):
        assert isinstance(cfg.backend, LlamaCppConfig)
        self.cfg = cfg
        self.b = cfg.backend
        self.model_path = model_path
        self.binary = binary
        self.kv_type = cfg.kv.per_backend["llamacpp"]
        self.base_url = ""
        self.served_name = cfg.model.name

    @property
    def parallel(self) -> int:
        s = self.cfg.scenario
        return self.b.parallel or highest_concurrency(s)

    @property
    def context(self) -> int:
        s = self.cfg.scenario
        # one slot must hold a whole request; -c is shared by all slots
        return self.b.context or self.parallel * (s.prompt_tokens + s.max_tokens + 16)

    def launch_argv(self, port: int) -> list[str]:
        if not self.binary or not self.model_path:
            raise BackendError("llamacpp: no binary or model to launch")
        argv = [self.binary, "-m", self.model_path, "--alias", self.served_name,
                "--host", self.b.host, "--port", str(port), "-np", str(self.parallel),
                "-c", str(self.context), "--metrics", "--slots",
                "-ctk", self.kv_type, "-ctv", self.kv_type, "-fa", self.b.flash_attn, "-lv", "4"]
        # all cores but one by default: the load generator needs a core of its own
        argv += ["-t", str(self.b.threads or max(1, (os.cpu_count() or 2) - 1))]
        if self.b.n_gpu_layers is not None:
            argv += ["-ngl", str(self.b.n_gpu_layers)]
        return argv + list(self.b.extra_args)

    def launch_env(self, port: int) -> dict[str, str]:
        return dict(self.b.env)

    def request(self, prompt: str | list[int], max_tokens: int, api: str) -> Request:
        # ignore_eos forces the length; cache_prompt off so no request is served from a prefix cache
        return openai.completion_request(self.served_name, prompt, max_tokens, api,
                                         {"ignore_eos": True, "cache_prompt": False})

    def parse_line(self, line: bytes) -> Optional[StreamEvent]:
        return openai.parse_sse_line(line)

    async def tokenize(self, session: aiohttp.ClientSession, text: str) -> list[int]:
        async with session.post(self.base_url + "/tokenize",
                                json={"content": text, "add_special": False}) as r:
            r.raise_for_status()
            return list((await r.json())["tokens"])

    async def chat_prompt_tokens(self, session: aiohttp.ClientSession, text: str) -> int:
        """Tokens the server will count for a chat request with this user message."""
        async with session.post(self.base_url + "/apply-template",
                                json={"messages": [{"role": "user", "content": text}]}) as r:
            r.raise_for_status()
            templated = (await r.json())["prompt"]
        async with session.post(self.base_url + "/tokenize",
                                json={"content": templated, "add_special": True}) as r:
            r.raise_for_status()
            return len((await r.json())["tokens"])

    async def version(self, session: aiohttp.ClientSession) -> Optional[str]:
        try:
            async with session.get(self.base_url + "/props") as r:
                if r.status == 200:
                    return (await r.json()).get("build_info")
        except aiohttp.ClientError:
            pass
        return None

    async def kv_cache(self, session: aiohttp.ClientSession, log_text: str) -> KVCacheInfo:
        info = parse_kv_log(log_text) or KVCacheInfo()
        try:
            async with session.get(self.base_url + "/slots") as r:
                if r.status == 200:
                    slots = await r.json()
                    info.seqs = len(slots)
                    info.source.append("/slots: number of slots")
                    if info.capacity_tokens is None:
                        info.capacity_tokens = sum(int(s.get("n_ctx") or 0) for s in slots) or None
                        info.source.append("/slots: sum of n_ctx")
        except aiohttp.ClientError:
            pass
        return info

    async def poll(self, session: aiohttp.ClientSession) -> TelemetrySample:
        sample = TelemetrySample()
        async with session.get(self.base_url + "/slots") as r:
            if r.status == 200:
                sample.kv_usage = slots_usage(await r.json())
        async with session.get(self.base_url + "/metrics") as r:
            if r.status == 200:
                m = parse_metrics(await r.text())
                sample.running = _int(m.get("llamacpp:requests_processing"))
                sample.waiting = _int(m.get("llamacpp:requests_deferred"))
                if "llamacpp:kv_cache_usage_ratio" in m:  # builds that have the gauge
                    sample.kv_usage = m["llamacpp:kv_cache_usage_ratio"]
        return sample


def _int(v: Optional[float]) -> Optional[int]:
    return None if v is None else int(v)
