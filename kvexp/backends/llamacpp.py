"""llama.cpp's llama-server: launch flags, requests, and the KV cache as the server states it.

The KV type and size are not in /props: the startup log states them at verbosity 4
(`llama_kv_cache: size = 1.06 MiB (1024 cells, 2 layers, 4/4 seqs), K (q8_0): 0.53 MiB, ...`).
/metrics has no KV-usage gauge in these builds, so usage is derived from /slots (tokens held by busy
slots over total slot context)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import aiohttp

from kvexp.backends import openai
from kvexp.backends.base import PORT, Adapter, Capabilities, KVCacheInfo, Request, ServerSpec, StreamEvent, TelemetrySample
from kvexp.backends.metrics import parse_metrics
from kvexp.config import BackendConfig, ConfigError, ExperimentConfig, highest_concurrency
from kvexp.planner import CacheModel

KV_LINE = re.compile(
    r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)/(\d+) seqs\),"
    r"\s*K \((\w+)\):\s*([\d.]+) MiB,\s*V \((\w+)\):\s*([\d.]+) MiB")
MIB = 1 << 20
CONTEXT_MARGIN = 16  # tokens beyond prompt + output in each slot's share of the default -c
CELL_PAD = 256  # llama-server rounds each slot's cells up to a multiple of this
UNIFIED_FLAGS = ("--kv-unified", "-kvu")


@dataclass
class LlamaCppConfig(BackendConfig):
    name: str = "llamacpp"
    binary: Optional[str] = None  # path or name on PATH; None: PATH, then kvexp's cached build
    threads: Optional[int] = None
    n_gpu_layers: Optional[int] = None
    flash_attn: str = "on"  # on | off | auto


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


class LlamaCpp(Adapter):
    name = "llamacpp"
    display_name = "llama.cpp"
    chart_marker = "s"
    config_class = LlamaCppConfig
    model_field = "gguf"
    installable = True
    capabilities = Capabilities(forces_output_length=True, exact_prompts=True, exposes_kv_usage=True,
                                exposes_preemptions=False, logprobs=True,
                                stream_keepalive=False)  # the server closes the connection after each stream
    cache_model = CacheModel(name="llamacpp", paged=False, cell_pad=CELL_PAD, default_slots=1)
    b: LlamaCppConfig

    @classmethod
    def locate_program(cls, cfg: ExperimentConfig) -> Optional[str]:
        from kvexp.install import find_llama_server

        found = find_llama_server(cfg.backend.binary)
        if found is None:
            where = f"backend.binary={cfg.backend.binary}" if cfg.backend.binary else "PATH or kvexp's cache"
            raise ConfigError(f"llama-server not found in {where}: run `python -m kvexp install llamacpp` "
                              "(builds it once, ~5 min) or set backend.binary=/path/to/llama-server")
        return str(found)

    @classmethod
    def locate_model(cls, cfg: ExperimentConfig, program: Optional[str]) -> Optional[str]:
        gguf = cfg.model.gguf
        if gguf == "@tiny":
            from kvexp.tinymodels import ensure_tiny_gguf

            return str(ensure_tiny_gguf())
        if not cfg.backend.endpoint and (not gguf or not Path(gguf).expanduser().is_file()):
            raise ConfigError(f"model.gguf={gguf!r}: no such GGUF file for model={cfg.model.name}")
        return gguf

    @classmethod
    def install(cls, force: bool = False) -> None:
        from kvexp.install import build_llama_server

        build_llama_server(force=force)

    @property
    def parallel(self) -> int:
        return self.spec.slots or 1

    @property
    def context(self) -> int:
        return self.spec.context_tokens or 0

    def _spec(self) -> ServerSpec:
        s, b = self.cfg.scenario, self.b
        slots = b.parallel or highest_concurrency(s)
        unified = any(a in UNIFIED_FLAGS for a in b.extra_args)
        # one slot must hold a whole request; -c is shared by all slots (or one stream with --kv-unified)
        context = b.context or (1 if unified else slots) * (s.prompt_tokens + s.max_tokens + CONTEXT_MARGIN)
        sources = {"parallel": "backend.parallel" if b.parallel else "derived: highest concurrency level",
                   "context_tokens": "backend.context" if b.context else
                   f"derived: {'' if unified else 'parallel x '}(prompt + output + {CONTEXT_MARGIN})"}
        argv = None
        if self.program and self.model_path:
            argv = [self.program, "-m", self.model_path, "--alias", self.served_name,
                    "--host", b.host, "--port", PORT, "-np", str(slots),
                    "-c", str(context), "--metrics", "--slots",
                    "-ctk", self.kv_type, "-ctv", self.kv_type, "-fa", b.flash_attn, "-lv", "4"]
            # all cores but one by default: the load generator needs a core of its own
            argv += ["-t", str(b.threads or max(1, (os.cpu_count() or 2) - 1))]
            if b.n_gpu_layers is not None:
                argv += ["-ngl", str(b.n_gpu_layers)]
            argv += list(b.extra_args)
        return self._make_spec(argv, dict(b.env), slots=slots, context=context,
                               per_seq=context if unified else context // slots, sources=sources,
                               unified_kv=unified)

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
