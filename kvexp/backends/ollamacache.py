"""What an Ollama server says about its KV cache, and how it sizes it.

Ollama 0.24.0 runs a model on one of two engines: its llama.cpp runner (the llama.cpp inside Ollama
prints `llama_kv_cache` lines; each slot's share of the context is padded as llama-server pads it) or,
for the architectures that require it (ENGINE_ARCHS: gemma3, qwen3, gpt-oss, ...), its own Go engine,
which logs the runner's load request (KV type, cells, slots) and the `kv cache` size per device, and
keeps one cache of context x slots cells with a sliding-window cache beside it for windowed models
(kvcache/causal.go). RUNNER_CACHE and ENGINE_CACHE are the planner's view of each."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from kvexp.backends.base import KVCacheInfo
from kvexp.backends.llamacpp import CELL_PAD, MIB, parse_kv_log
from kvexp.backends.llamacpp import logged_buffers as llama_buffers
from kvexp.capacity import gguffile
from kvexp.capacity.cpumemory import CpuMemoryModel, ServerBuffers
from kvexp.capacity.planner import CacheModel

BATCH = 512  # Ollama's default num_batch (llm/server.go: min(NumBatch, NumCtx))

def default_context_tokens(gpu_gib: Optional[float], model_context_tokens: Optional[int] = None) -> int:
    """Ollama's default OLLAMA_CONTEXT_LENGTH by VRAM: < 24 GiB 4k, 24-48 GiB 32k, >= 48 GiB 256k
    (capped at the model's own context where known)."""
    if gpu_gib is None or gpu_gib < 24:
        ctx = 4096
    elif gpu_gib < 48:
        ctx = 32768
    else:
        ctx = 262144
    return min(ctx, model_context_tokens) if model_context_tokens else ctx


def window_cells(window: int, context: int, slots: int, unified: bool) -> int:
    """The cells Ollama's own engine gives a sliding-window cache (kvcache/causal.go, Causal.Init; gemma3
    wraps a NewSWACache beside its causal cache): one window per sequence (+1 with several), plus
    one batch of min(512, context) cells, padded to 256; a window as long as a sequence's context
    keeps the whole context instead (context x slots, padded)."""
    keep = window + (1 if slots > 1 else 0)
    cells = context * slots if keep >= context else slots * keep + min(BATCH, context)
    return -(-cells // CELL_PAD) * CELL_PAD


# Architectures Ollama 0.24.0 runs on its own engine rather than its llama.cpp runner
# (fs/ggml/ggml.go, KV.OllamaEngineRequired); its cache is sized as ENGINE_CACHE says
ENGINE_ARCHS = frozenset(("bert", "deepseek2", "deepseekocr", "gemma3", "gemma3n", "gemma4", "gptoss", "gpt-oss",
                          "laguna", "llama4", "mistral3", "mllama", "nemotron_h", "nemotron_h_moe", "nemotron_h_omni",
                          "nomic-bert", "olmo3", "qwen25vl", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next",
                          "qwen3vl", "qwen3vlmoe", "glm4moelite", "glmocr", "lfm2", "lfm2moe"))


# The fallbacks Ollama logs when it does not apply OLLAMA_KV_CACHE_TYPE (the runner then uses f16).
_FALLBACKS = (
    "quantized kv cache requested but flash attention disabled",
    "OLLAMA_FLASH_ATTENTION must be enabled to use a quantized OLLAMA_KV_CACHE_TYPE",
    "unsupported OLLAMA_KV_CACHE_TYPE",
    "kv cache type not supported by model",
)
# llama.cpp before the `llama_kv_cache: size = ...` line (Ollama's cgo runners up to 2025).
_OLD_SIZE = re.compile(r"KV self size\s*=\s*([\d.]+) MiB, K \((\w+)\):\s*[\d.]+ MiB, V \((\w+)\)")
_OLD_CELLS = re.compile(r"kv_size = (\d+), type_k = '(\w+)', type_v = '(\w+)'")
# Ollama >= 0.30 runs llama-server and logs its command line.
_LAUNCH = re.compile(r'msg="starting llama-server" cmd="([^"]*)"')
# Ollama's own engine (0.12 - 0.2x) logs the KV size per device, not the type.
_ENGINE_KV = re.compile(r'msg="kv cache" device=(\S+) size="([\d.]+) (B|KiB|MiB|GiB|TiB)"')
# Ollama's own engine: the runner's load request states the KV type it was given (empty: f16), the
# cells (num_ctx x parallel) and the slots (runner/ollamarunner/runner.go)
_LOAD_REQUEST = re.compile(r'msg=load request="\{[^"]*?Parallel:(\d+)[^"]*?KvSize:(\d+) KvCacheType:(\w*)')
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
# What the runner holds beside its KV cache, per device (llm/device.go): `msg="model weights" device=CPU
# size="405.2 MiB"` (its own engine keeps some tensors in another type than the file's), `msg="compute graph"
# device=CPU size="4.9 MiB"` (its own engine; its llama.cpp runner prints llama.cpp's buffer lines instead)
_DEVICE_SIZE = re.compile(r'msg="(model weights|compute graph)" device=(\S+) size="([\d.]+) (B|KiB|MiB|GiB|TiB)"')


def logged_buffers(log_text: str) -> Optional[ServerBuffers]:
    """What an Ollama runner holds on the CPU beside its KV cache, as the server's log states it: the weights
    as it holds them, its compute graph and output buffers (kvexp/capacity/cpumemory.py); None: not stated."""
    sizes: dict[str, int] = {}
    for what, device, num, unit in _DEVICE_SIZE.findall(log_text):
        if device == "CPU":
            sizes[what] = round(float(num) * _UNITS[unit])  # the last load's
    weights = sizes.get("model weights")
    llama = llama_buffers(log_text)  # the llama.cpp runner's own lines
    log = "the server's log: "
    said = log + "model weights" + (f" {weights / MIB:.2f} MiB" if weights is not None else " not stated")
    if llama is not None:
        return ServerBuffers(llama.fixed_bytes, llama.compute_bytes, llama.ubatch_tokens,
                             f"{said}; {llama.source.removeprefix(log)}", weights)
    if not sizes:
        return None
    graph = sizes.get("compute graph")
    return ServerBuffers(0, graph or 0, None, said + (f", compute graph {graph / MIB:.2f} MiB" if graph else ""),
                         weights)

def parse_server_log(log_text: str, requested: str) -> KVCacheInfo:
    """The KV cache as an Ollama server log states it; dtype stays None unless the log confirms one."""
    info = parse_kv_log(log_text)  # llama.cpp's size line, printed by the runner Ollama launches
    if info is not None:
        info.source = [f"{src}, printed by Ollama's runner" for src in info.source]
    else:
        info = _old_llama_lines(log_text)
    launch = _LAUNCH.findall(log_text)
    if launch:
        args = launch[-1].split()
        seqs = _flag(args, "-np")
        if info is not None and info.seqs is None and seqs is not None:
            info.seqs = seqs
            info.source.append("server log: -np of the llama-server command line")
        if info is None:
            k, v = _flag_str(args, "--cache-type-k"), _flag_str(args, "--cache-type-v")
            # not passed: llama-server's default cache type, f16
            k, v = k or "f16", v or "f16"
            ctx = _flag(args, "-c")
            info = KVCacheInfo(dtype=k if k == v else f"{k}/{v}", dtype_k=k, dtype_v=v,
                               capacity_tokens=ctx, seqs=seqs,
                               source=["server log: the llama-server command line Ollama started "
                                       "(--cache-type-k/-v; f16 when not passed)"])
    if info is None and (load := _LOAD_REQUEST.findall(log_text)):
        parallel, cells, kv = load[-1]
        kv = kv or "f16"
        info = KVCacheInfo(dtype=kv, dtype_k=kv, dtype_v=kv, capacity_tokens=-(-int(cells) // CELL_PAD) * CELL_PAD,
                           seqs=int(parallel),
                           source=["server log: the runner's load request (KvCacheType, empty for f16; KvSize: "
                                   "num_ctx x parallel cells, which its cache pads to 256; Parallel)"])
    if info is None:
        fallback = next((f for f in _FALLBACKS if f in log_text), None)
        if fallback:
            info = KVCacheInfo(dtype="f16", dtype_k="f16", dtype_v="f16", source=[
                f"server log: {fallback!r}: OLLAMA_KV_CACHE_TYPE={requested} was not applied; "
                "the runner uses its default f16"])
    if info is None:
        info = KVCacheInfo(source=[f"requested via OLLAMA_KV_CACHE_TYPE={requested}, not reported by the "
                                   "server (no KV cache line in its log)"])
    if info.bytes is None:
        engine = _engine_kv_bytes(log_text)
        if engine is not None:
            info.bytes = engine
            info.source.append("server log: 'kv cache' size per device (rounded by the server)")
    return info


def _old_llama_lines(log_text: str) -> Optional[KVCacheInfo]:
    sizes, cells = _OLD_SIZE.findall(log_text), _OLD_CELLS.findall(log_text)
    if not sizes and not cells:
        return None
    info = KVCacheInfo(source=["server log: llama.cpp KV self size / kv_size lines (older runner)"])
    k = v = None
    if cells:
        n, k, v = cells[-1]
        info.capacity_tokens = int(n)
    if sizes:
        size, k, v = sizes[-1]
        info.bytes = round(float(size) * MIB)
    info.dtype_k, info.dtype_v = k, v
    info.dtype = k if k == v else f"{k}/{v}"
    return info


def _engine_kv_bytes(log_text: str) -> Optional[int]:
    per_device: dict[str, int] = {}
    for device, num, unit in _ENGINE_KV.findall(log_text):
        per_device[device] = round(float(num) * _UNITS[unit])  # the last load's figure per device
    return sum(per_device.values()) if per_device else None


def _flag_str(args: list[str], flag: str) -> Optional[str]:
    for i, a in enumerate(args[:-1]):
        if a == flag:
            return args[i + 1]
    return None


def _flag(args: list[str], flag: str) -> Optional[int]:
    v = _flag_str(args, flag)
    return int(v) if v is not None and v.isdigit() else None


ENGINE_CACHE = CacheModel(name="ollama", paged=False, context_per_slot=True, default_slots=1, cell_pad=CELL_PAD,
                          default_context=default_context_tokens, window_cells=window_cells, pad_whole=True)


def gguf_architecture(gguf: Path) -> Optional[str]:
    """general.architecture of a GGUF (its header, read once per file); None where it cannot be read."""
    try:
        return str(gguffile.read_header(gguf).metadata.get("general.architecture"))
    except (OSError, gguffile.GGUFError):
        return None


# cell_pad: the llama.cpp runner's context is rounded up like llama-server's (OLLAMA_CONTEXT_LENGTH=144
# with 2 slots: 2 x 256 cells, as its log's llama_kv_cache line says); a model Ollama runs on its own
# engine gets ENGINE_CACHE instead (one cache of context x slots cells, its sliding windows sized)
RUNNER_CACHE = CacheModel(name="ollama", paged=False, context_per_slot=True, default_slots=1, cell_pad=CELL_PAD,
                          default_context=default_context_tokens)


# Its resident memory on the CPU (kvexp/capacity/cpumemory.py), its serve process and its runner together:
# the runtime beside the weights and buffers its log states and the KV cache, as base + per token + per BPE
# merge, fitted by least squares to 6 levels of Ollama 0.24.0 on this machine (AMD EPYC, 2 cores): kvexp's tiny
# model (356 tokens) and SmolLM2-135M (49,152 tokens, 48,900 merges) on its llama.cpp runner, Gemma 3 270M
# (262,144 tokens) on its own engine; 2 slots, scenario smoke. Residuals within 1.5 MiB but Gemma 3's, 14.4 MiB
# either side (its two levels measured 29 MiB apart). Its runner keeps no prompt cache beside the KV cache.
CPU_MEMORY = CpuMemoryModel(
    "ollama", round(74.0 * MIB), "fitted to the measured RSS of 6 levels of Ollama 0.24.0 (tiny, SmolLM2-135M, "
    "Gemma 3 270M; kvexp/backends/ollamacache.py): base + per token + per merge",
    runtime_per_vocab_bytes=448, runtime_per_merge_bytes=486, logs_buffers=True)
