"""llama.cpp's llama-server: launch flags, requests, and the KV cache as the server states it.

The KV type and size are not in /props: the startup log states them at verbosity 4
(`llama_kv_cache: size = 1.06 MiB (1024 cells, 2 layers, 4/4 seqs), K (q8_0): 0.53 MiB, ...`).
/metrics has no KV-usage gauge in these builds, so usage is derived from /slots (tokens held by busy
slots over total slot context)."""

from __future__ import annotations

import functools
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import aiohttp

from kvexp.assets import cuda, embedded
from kvexp.assets.install import build_llama_server, find_llama_server
from kvexp.backends import openai
from kvexp.backends.base import (PORT, Adapter, BackendError, Capabilities, KVCacheInfo, Request, ServerSpec,
                                 StreamEvent, TelemetrySample, answer_json, reported_version)
from kvexp.backends.prometheus import parse_metrics
from kvexp.capacity import gguffile, modelinfo
from kvexp.capacity.cpumemory import CpuMemoryModel, ServerBuffers
from kvexp.capacity.planner import KV_BYTES_PER_ELEMENT, CacheModel, kv_pair
from kvexp.core.config import BackendConfig, ConfigError, ExperimentConfig, FlashAttn, KVRotation, server_slots
from kvexp.core.paths import cache_dir, file_problem
from kvexp.workload import scenario

KV_LINE = re.compile(
    r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)/(\d+) seqs\),"
    r"\s*K \((\w+)\):\s*([\d.]+) MiB,\s*V \((\w+)\):\s*([\d.]+) MiB")
ROTATION_LINE = re.compile(r"attn_rot_([kv]) = (\d+)")  # llama_kv_cache: attn_rot_k = 1, n_embd_head_k_all = 64
ROTATION_OFF_ENV = "LLAMA_ATTN_ROT_DISABLE"
LOADED_LINE = ": model loaded"  # `srv  llama_server: model loaded` (older builds: `main: model loaded`)
MIB = 1 << 20
CONTEXT_MARGIN = 16  # tokens beyond prompt + output in each slot's share of the default -c
ALL_LAYERS = 999  # -ngl that offloads every layer (more than any model has), the default where a GPU is here
CELL_PAD = 256  # llama-server rounds each slot's cells up to a multiple of this
UBATCH = 512  # llama-server's default -ub (common/common.h: n_ubatch)
# `llama_kv_cache_iswa: creating     SWA KV cache, size = 1024 cells`: the next size line is the window's
SWA_LINE = re.compile(r"llama_kv_cache_iswa: creating +(non-SWA|SWA) KV cache")


def window_cells(window: int, cells: int, slots: int, unified: bool) -> int:
    """The cells the sliding-window cache holds in all streams, as llama.cpp sizes it
    (src/llama-kv-cache-iswa.cpp, llama_kv_cache_iswa's constructor, without --swa-full): in each
    stream the window (once per sequence in a unified stream) plus one micro-batch, at most the
    stream's own cells, padded to 256; one stream per slot unless unified."""
    per_stream = -(-min(cells, window * (slots if unified else 1) + UBATCH) // CELL_PAD) * CELL_PAD
    return per_stream * (1 if unified else slots)
UNIFIED_FLAGS = ("--kv-unified", "-kvu")
CACHE_RAM_FLAGS = ("--cache-ram", "-cram")
# Its resident memory on the CPU (kvexp/capacity/cpumemory.py): the runtime beside the weights, the buffers its
# log states, the KV cache and the prompt cache, as base + per vocabulary entry + per BPE merge (the tokenizer's
# tables) + per slot. Fitted by least squares to the measured peak RSS less those parts, per level, of 19
# levels of llama-server 0.3.36-b2 on this machine (AMD EPYC, 2 cores): SmolLM2-135M Q4_1 (49,152 tokens,
# 48,900 merges), Gemma 3 270M Q4_K_M (262,144 tokens, no merges) and kvexp's tiny model (356 tokens), 1, 2
# and 4 slots, -c 128 to 4096, KV f16, q8_0 and q8_0/q4_0, scenarios smoke and cpu, the prompt cache on and
# off; every residual within 3.1 MiB.
RUNTIME_BASE_BYTES = round(13.87 * MIB)
RUNTIME_PER_VOCAB_BYTES = 213
RUNTIME_PER_MERGE_BYTES = 161
RUNTIME_PER_SLOT_BYTES = round(1.74 * MIB)
RUNTIME_SOURCE = ("fitted to the measured RSS of 19 levels of llama-server 0.3.36-b2 (SmolLM2-135M, Gemma 3 270M, "
                  "kvexp's tiny model; 1-4 slots; kvexp/backends/llamacpp.py): base + per token + per merge + per slot")
PROMPT_CACHE_MIB = 8192  # llama-server's default --cache-ram (common/common.h: cache_ram_mib = 8192)
# `sched_reserve:        CPU compute buffer size =    13.76 MiB`, `llama_context:        CPU  output buffer size
# =     0.75 MiB`, `load_tensors:   CPU_REPACK model buffer size =    ... MiB` (weights copied into memory of its
# own; a `CPU_Mapped` model buffer is the mapped file and a plain `CPU` one the file read in: the weights)
BUFFER_LINE = re.compile(r"(\w+)\s+(compute|output|model) buffer size =\s*([\d.]+) MiB")
UBATCH_LINE = re.compile(r"llama_context: n_ubatch\s*=\s*(\d+)")
# a line of `llama-server --help` that names an option: its spellings, then the placeholder of its value(s)
HELP_OPTION = re.compile(r"((?:-{1,2}[A-Za-z][\w.-]*)(?:,\s+-{1,2}[A-Za-z][\w.-]*)*)(?: ([^ ].*?))?(?:\s{2,}|$)")


def logged_buffers(log_text: str) -> Optional[ServerBuffers]:
    """The output and compute buffers and the weights copied out of the mapped file, as llama-server's log
    states them at start (each buffer's last line: a reserve repeated after a retry states it again), with
    the micro-batch the compute buffer is sized for; None where it states none."""
    found: dict[tuple[str, str], float] = {}
    for m in BUFFER_LINE.finditer(log_text):
        # a *_Mapped model buffer is the mapped file and a plain CPU one the file read into memory (no mmap):
        # the weights, counted as the file; others (CPU_REPACK, AMX) are copies beside it
        if m.group(2) != "model" or not (m.group(1).endswith("_Mapped") or m.group(1) == "CPU"):
            found[(m.group(1), m.group(2))] = float(m.group(3))
    if not found:
        return None
    ubatch = UBATCH_LINE.findall(log_text)
    names = ", ".join(f"{buft} {kind} {mib:.2f} MiB" for (buft, kind), mib in found.items())
    compute = sum(mib for (_, kind), mib in found.items() if kind == "compute")
    return ServerBuffers(round((sum(found.values()) - compute) * MIB), round(compute * MIB),
                         int(ubatch[-1]) if ubatch else None,
                         f"the server's log: {names}" + (f" (n_ubatch = {ubatch[-1]})" if ubatch else ""))


def cache_ram_bytes(argv: list[str]) -> tuple[int, str]:
    """The most llama-server keeps of finished prompts' states in memory (--cache-ram MiB; -1 no limit),
    and where that came from."""
    for i, a in enumerate(argv[:-1]):
        if a in CACHE_RAM_FLAGS:
            mib = int(argv[i + 1])
            return (1 << 62 if mib < 0 else mib * MIB), f"{a} {argv[i + 1]} (MiB)"
    return PROMPT_CACHE_MIB * MIB, f"llama-server's default --cache-ram {PROMPT_CACHE_MIB} MiB"


def slot_dir() -> Path:
    """Where llama-server may save slots (--slot-save-path, which also enables erasing them; kvexp
    never saves one): kvexp's cache folder."""
    path = cache_dir() / "slots"
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class LlamaCppConfig(BackendConfig):
    name: str = "llamacpp"
    binary: Optional[str] = None  # path or name on PATH; None: PATH, then kvexp's cached build
    threads: Optional[int] = None
    n_gpu_layers: Optional[int] = None
    flash_attn: FlashAttn = FlashAttn.on
    kv_rotation: KVRotation = KVRotation.auto  # off: no Hadamard rotation of quantised K/V

    def kv_tag(self) -> str:
        return "-norot" if self.kv_rotation == KVRotation.off else ""


def parse_kv_log(log_text: str) -> Optional[KVCacheInfo]:
    """The context's own KV cache from a llama-server log: its last llama_kv_cache size line, or for a
    sliding-window model the last pair (`llama_kv_cache_iswa: creating non-SWA KV cache` and `creating
    SWA KV cache`, each followed by its size line).

    A size line reads `(<cells> cells, <layers> layers, <seq_max>/<streams> seqs)`: the cells are per
    stream, and with -np N (no unified cache) every slot has a stream of its own, so the cache holds
    cells x streams tokens; the size in MiB is the total. With a window, capacity_tokens is the global
    layers' cells, window_tokens the sliding layers', and bytes the two sizes together."""
    caches = kv_size_lines(log_text)
    if not caches:
        return None
    (size, cells, _layers, seq_max, streams, k, _ks, v, _vs, _), window = caches[-1], None
    if len(caches) > 1 and caches[-1][9] == "SWA" and caches[-2][9] == "non-SWA":
        (size, cells, _layers, seq_max, streams, k, _ks, v, _vs, _), window = caches[-2], caches[-1]
    info = KVCacheInfo(
        dtype=k if k == v else f"{k}/{v}", dtype_k=k, dtype_v=v,
        capacity_tokens=int(cells) * int(streams), bytes=round(float(size) * MIB), seqs=int(seq_max),
        source=["server log: llama_kv_cache size line (cells x streams)"],
    )
    if window is not None:
        info.window_tokens = int(window[1]) * int(window[4])
        info.bytes = round((float(size) + float(window[0])) * MIB)
        info.source = ["server log: llama_kv_cache_iswa's two caches: the global layers' cells x streams "
                       "(capacity), the sliding layers' cells x streams (window), their sizes added (bytes)"]
    rotation = dict(ROTATION_LINE.findall(log_text))  # the last of each (builds from 2026 on state it)
    if rotation:
        info.rotation_k, info.rotation_v = (rotation[x] != "0" if x in rotation else None for x in "kv")
        info.source.append("server log: llama_kv_cache attn_rot_k / attn_rot_v lines (rotation)")
    return info


def kv_size_lines(log_text: str) -> list[tuple[str, ...]]:
    """Every llama_kv_cache size line's fields, each with the kind of cache the iSWA line before it
    created ("non-SWA", "SWA", or "" for a model without a window) as its last field."""
    out, kind = [], ""
    for line in log_text.splitlines():
        if m := SWA_LINE.search(line):
            kind = m.group(1)
        elif m := KV_LINE.search(line):
            out.append((*m.groups(), kind))
            kind = ""
    return out


SLOT_FIELDS = {"id": int, "n_ctx": int}  # what kvexp reads of every slot /slots lists


def slots_usage(slots: list[dict[str, Any]], unified: bool = False) -> Optional[float]:
    """Fraction of the KV cache held by busy slots.

    A slot's `n_prompt_tokens` is its token list, which holds every cell it fills: the prompt and each
    token decoded so far (verified on the real server: during decoding it is prompt + n_decoded, or one
    less between decodes; `tests/fixtures/llamacpp/slots_decoding_np4*.json`), so decoded tokens are not
    added again. An idle slot keeps reporting its last count, so only `is_processing` slots count.
    The cache is the sum of the slots' n_ctx, or with --kv-unified one stream that every slot reports
    as its n_ctx."""
    sizes = [int(s.get("n_ctx") or 0) for s in slots]
    total = max(sizes, default=0) if unified else sum(sizes)
    if total <= 0:
        return None
    used = sum(int(s.get("n_prompt_tokens") or 0) for s in slots if s.get("is_processing"))
    return min(1.0, used / total)


def exact_kv_bytes(cells: int, layers: int, n_embd_kv: int, k_type: str, v_type: str) -> Optional[int]:
    """The KV cache's bytes from its cells: cells x layers x (K + V bytes per cell), each ggml block of
    32 elements of q8_0/q4_0 stored with its scale (the server's log rounds this to 0.01 MiB)."""
    try:
        per_cell = n_embd_kv * (KV_BYTES_PER_ELEMENT[k_type] + KV_BYTES_PER_ELEMENT[v_type])
    except KeyError:
        return None
    return round(cells * layers * per_cell)


def rotates(kv_type: str) -> bool:
    """Whether a KV type (or either type of a K/V pair "q8_0/f16") is one llama.cpp may rotate (a quantised
    one, not f16/bf16/f32)."""
    return any(t not in ("f16", "bf16", "f32") for t in kv_pair(kv_type))


def check_gguf_model(cfg: ExperimentConfig) -> None:
    """A GGUF that is there and is a GGUF (its header read, in milliseconds), before any launch (llama.cpp,
    and Ollama importing a file)."""
    if cfg.backend.endpoint:
        return
    gguf = cfg.model.gguf
    if gguf in embedded.WHEEL_MODELS:
        embedded.gguf_file(gguf)  # installed, else the one-line error saying how
    elif not embedded.is_embedded(gguf):
        problem = file_problem(Path(gguf).expanduser()) if gguf else "no such file"
        if problem:
            raise ConfigError(f"model.gguf={gguf!r}: {problem} (a GGUF file is needed for model={cfg.model.name})")
        try:
            gguffile.read_header(Path(gguf).expanduser())
        except gguffile.GGUFError as e:
            raise ConfigError(f"model.gguf: {e}") from None


def server_flags(program: str) -> dict[str, int]:
    """Each flag this llama-server build reads -> how many values follow it, from its own --help (builds
    differ); {} when its help cannot be read. Cached per binary and modification."""
    try:
        st = os.stat(program)
    except OSError:
        return {}
    return _help_flags(program, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _help_flags(program: str, mtime_ns: int, size: int) -> dict[str, int]:
    try:
        text = subprocess.run([program, "--help"], capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    flags: dict[str, int] = {}
    for line in text.splitlines():
        m = HELP_OPTION.match(line) if line.startswith("-") else None
        if m:  # "START END" takes two values; "<tensor name pattern>=<buffer type>,..." one
            values = len(re.sub(r"<[^>]*>", "x", m.group(2)).split()) if m.group(2) else 0
            flags.update(dict.fromkeys((f.strip() for f in m.group(1).split(",")), values))
    return flags


def extra_args_problem(program: str, args: list[str]) -> Optional[str]:
    """What llama-server would refuse in backend.extra_args as it parses them (each item a flag it reads,
    followed by its values; `--` flags may use _ for -), or None. It exits before it is ready on any."""
    flags = server_flags(program) if args else {}
    i = 0
    while flags and i < len(args):
        arg = str(args[i])
        key = arg.replace("_", "-") if arg.startswith("--") else arg
        if key not in flags:
            glued = next((f for f in sorted(flags, key=len, reverse=True) if flags[f] and key.startswith(f)), None)
            hint = (f"; a flag and its value are two items: [{glued},{key[len(glued):].lstrip('=')}]" if glued else
                    f" (`{program} --help` lists every one)")
            return f"backend.extra_args: {arg!r} is not a flag this llama-server reads{hint}"
        if i + flags[key] >= len(args):
            return f"backend.extra_args: {arg} takes {flags[key]} value(s), and the list ends before them"
        i += 1 + flags[key]
    return None


class LlamaCpp(Adapter):
    name = "llamacpp"
    display_name = "llama.cpp"
    chart_marker = "s"
    config_class = LlamaCppConfig
    model_field = "gguf"
    installable = True
    cuda_build = True
    kv_pairs = True  # -ctk and -ctv: a K/V pair such as kv=q8_0/q4_0
    capabilities = Capabilities(forces_output_length=True, exact_prompts=True, exposes_kv_usage=True,
                                exposes_preemptions=False, logprobs=True,
                                stream_keepalive=False)  # the server closes the connection after each stream
    cache_model = CacheModel(name="llamacpp", paged=False, cell_pad=CELL_PAD, default_slots=1,
                             window_cells=window_cells)
    # /slots is a task of the server's own loop (answered between the steps of a decode), where /health is
    # answered by the HTTP threads alone: they still answer it when the loop is deadlocked, as it is when
    # llama-server's SIGTERM handler takes the task-queue lock the interrupted main thread holds
    watch_path = "/slots"
    b: LlamaCppConfig

    @classmethod
    def locate_program(cls, cfg: ExperimentConfig) -> Optional[str]:
        found = find_llama_server(cfg.backend.binary)
        if found is None:
            where = f"backend.binary={cfg.backend.binary}" if cfg.backend.binary else "PATH or kvexp's cache"
            raise ConfigError(f"llama-server not found in {where}: run `python -m kvexp install llamacpp` "
                              "(builds it once, ~5 min) or set backend.binary=/path/to/llama-server")
        return str(found)

    @classmethod
    def check_model(cls, cfg: ExperimentConfig) -> None:
        check_gguf_model(cfg)

    @classmethod
    def locate_model(cls, cfg: ExperimentConfig, program: Optional[str]) -> Optional[str]:
        cls.check_model(cfg)
        gguf = cfg.model.gguf
        return str(embedded.gguf_file(gguf)) if embedded.is_embedded(gguf) else gguf

    @classmethod
    def install(cls, force: bool = False, build: str = "cpu") -> None:
        build_llama_server(force=force, build=build, nvcc=cuda.find_nvcc() if build == "cuda" else None)
        embedded.install_wheel_model()

    @property
    def parallel(self) -> int:
        return self.spec.slots or 1

    @property
    def context(self) -> int:
        return self.spec.context_tokens or 0

    def _spec(self) -> ServerSpec:
        s, b = self.cfg.scenario, self.b
        k_type, v_type = kv_pair(self.kv_type)
        if rotates(v_type) and b.flash_attn == FlashAttn.off and not b.endpoint:
            # llama-server: "V cache quantization requires flash_attn" (a quantised K is fine without it)
            raise ConfigError(f"kv={self.cfg.kv.name} (-ctv {v_type}) with backend.flash_attn=off: llama-server "
                              "refuses a quantised V cache without flash attention (it exits before it is ready); "
                              "use backend.flash_attn=on or auto")
        slots, slots_source = server_slots(s, b.parallel)
        unified = any(a in UNIFIED_FLAGS for a in b.extra_args)
        # one slot must hold a whole request; -c is shared by all slots (or one stream with --kv-unified)
        context = b.context or (1 if unified else slots) * (scenario.longest_sequence(s) + CONTEXT_MARGIN)
        sources_gpu = {"n_gpu_layers": f"derived: an NVIDIA GPU is here, every layer offloaded (-ngl {ALL_LAYERS})"
                       } if b.n_gpu_layers is None and self.gpu_layers is not None else {}
        sources = {**sources_gpu, "parallel": slots_source,
                   "context_tokens": "backend.context" if b.context else
                   f"derived: {'' if unified else 'parallel x '}(the longest request's prompt + output + "
                   f"{CONTEXT_MARGIN})"}
        argv = None
        if self.program and self.model_path:
            argv = [self.program, "-m", self.model_path, "--alias", self.served_name,
                    "--host", b.host, "--port", PORT, "-np", str(slots),
                    "-c", str(context), "--metrics", "--slots",
                    "-ctk", k_type, "-ctv", v_type, "-fa", str(b.flash_attn), "-lv", "4"]
            argv += ["-t", str(self.threads)]
            argv += self._cache_args()
            layers = self.gpu_layers
            if layers is not None:
                argv += ["-ngl", str(layers)]
            problem = extra_args_problem(self.program, list(b.extra_args))
            if problem:
                raise ConfigError(problem)
            argv += list(b.extra_args)
        env = dict(b.env)
        if ROTATION_OFF_ENV in env:
            raise ConfigError(f"backend.env.{ROTATION_OFF_ENV}: use backend.kv_rotation=off (recorded with the "
                              "KV dtype in every result and report)")
        if b.kv_rotation == KVRotation.off:
            env[ROTATION_OFF_ENV] = "1"
        return self._make_spec(argv, env, slots=slots, context=context,
                               per_seq=context if unified else context // slots, sources=sources,
                               unified_kv=unified)

    def request(self, prompt: Any, max_tokens: int, api: str, cache: bool = False) -> Request:
        # ignore_eos forces the length; cache_prompt only for workloads that reuse prompts, so that no
        # unique prompt is served from a prefix cache
        return openai.completion_request(self.served_name, prompt, max_tokens, api,
                                         {"ignore_eos": True, "cache_prompt": cache})

    def parse_line(self, line: bytes) -> Optional[StreamEvent]:
        return openai.parse_sse_line(line)

    async def tokenize(self, session: aiohttp.ClientSession, text: str) -> list[int]:
        async with session.post(self.base_url + "/tokenize",
                                json={"content": text, "add_special": False}) as r:
            r.raise_for_status()
            return list((await answer_json(r, tokens=list))["tokens"])

    async def chat_prompt_tokens(self, session: aiohttp.ClientSession, text: Any) -> int:
        """Tokens the server will count for a chat request with this user message (or these messages)."""
        async with session.post(self.base_url + "/apply-template",
                                json={"messages": openai.chat_messages(text)}) as r:
            r.raise_for_status()
            templated = (await answer_json(r, prompt=str))["prompt"]
        async with session.post(self.base_url + "/tokenize",
                                json={"content": templated, "add_special": True}) as r:
            r.raise_for_status()
            return len((await answer_json(r, tokens=list))["tokens"])

    async def version(self, session: aiohttp.ClientSession) -> Optional[str]:
        return await reported_version(session, self.base_url + "/props", "build_info")

    async def kv_cache(self, session: aiohttp.ClientSession, log_text: str) -> KVCacheInfo:
        info = parse_kv_log(log_text) or KVCacheInfo()
        self._exact_bytes(info, log_text)
        try:
            async with session.get(self.base_url + "/slots") as r:
                if r.status == 200:
                    slots = await answer_json(r, list, **SLOT_FIELDS)
                    info.seqs = len(slots)
                    info.source.append("/slots: number of slots")
                    if info.capacity_tokens is None:
                        info.capacity_tokens = sum(int(s.get("n_ctx") or 0) for s in slots) or None
                        info.source.append("/slots: sum of n_ctx")
        except aiohttp.ClientError:
            pass
        return info

    teacher_forced = "perplexity_tool"

    def continuation_request(self, prompt: Any, max_tokens: int, top_k: int, seed: int) -> Optional[Request]:
        return Request("/completion", {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0,
                                       "seed": seed, "cache_prompt": False, "ignore_eos": True,
                                       "n_probs": top_k, "return_tokens": True})

    def parse_continuation(self, data: dict[str, Any]) -> tuple[list[Any], list[Optional[dict[int, float]]]]:
        probs = data.get("completion_probabilities") or []
        tokens = list(data.get("tokens") or [p.get("id") for p in probs])
        tops = [{int(t["id"]): float(t["logprob"]) for t in p.get("top_logprobs") or []} or None for p in probs]
        return tokens, tops + [None] * (len(tokens) - len(tops))

    numerics_env = {ROTATION_OFF_ENV: "backend.kv_rotation=off"}
    managed_flags = {
        **dict.fromkeys(("-m", "--model", "--alias", "-a"), "model= (model.gguf)"),
        **dict.fromkeys(("--host", "--port"), "backend.host and backend.port"),
        **dict.fromkeys(("-np", "--parallel"), "backend.parallel"),
        **dict.fromkeys(("-c", "--ctx-size"), "backend.context"),
        **dict.fromkeys(("-ctk", "--cache-type-k", "-ctv", "--cache-type-v"), "kv= (or kv.per_backend.llamacpp)"),
        **dict.fromkeys(("-fa", "--flash-attn"), "backend.flash_attn"),
        **dict.fromkeys(("-t", "--threads"), "backend.threads"),
        **dict.fromkeys(("-ngl", "--gpu-layers", "--n-gpu-layers"), "backend.n_gpu_layers"),
        **dict.fromkeys(("-lv", "--verbosity", "--log-verbosity", "--metrics", "--slots", "--no-slots",
                         "--slot-save-path", "--log-disable"),
                        "nothing: kvexp reads the server's log, metrics and slots through them"),
    }
    flag_env_prefix = "LLAMA_ARG_"  # LLAMA_ARG_CTX_SIZE, LLAMA_ARG_KV_UNIFIED, ... (llama.cpp's common/arg.cpp)

    @property
    def gpu_layers(self) -> Optional[int]:
        """-ngl: backend.n_gpu_layers, else every layer (ALL_LAYERS) where an NVIDIA GPU is here, else None
        (not passed: the CPU launch stays as it was)."""
        if self.b.n_gpu_layers is not None:
            return self.b.n_gpu_layers
        return ALL_LAYERS if not self.b.endpoint and cuda.gpu_present() else None

    def numerics(self, kv_type: Optional[str] = None) -> dict[str, Any]:
        out = {"flash_attn": str(self.b.flash_attn), "threads": self.threads, "n_gpu_layers": self.gpu_layers}
        if rotates(kv_type or self.kv_type):  # a 16-bit cache is never rotated: its numbers do not depend on it
            out["kv_rotation"] = str(self.b.kv_rotation)
        return out

    def log_states_kv(self, log_text: str) -> bool:
        # the server states its model loaded after every line about the cache (one logger, in order)
        return LOADED_LINE in log_text

    def check_kv(self, info: KVCacheInfo) -> Optional[str]:
        """The rotation the server applied against backend.kv_rotation (None: they agree, or the build
        does not say)."""
        applied = [r for r in (info.rotation_k, info.rotation_v) if r is not None]
        if self.b.kv_rotation == KVRotation.off and any(applied):
            return (f"the server rotates its {self.kv_type} KV cache (attn_rot = 1 in its log) although "
                    f"backend.kv_rotation=off set {ROTATION_OFF_ENV}=1")
        return None

    def _cache_args(self) -> list[str]:
        """The prompt-cache flags kvexp adds: slots can be erased between levels (reset_cache), and the
        host-RAM prompt cache, which would outlive a slot erase, is off unless backend.extra_args sizes it."""
        if not scenario.resets_cache(self.cfg.scenario):
            return []
        off = [] if any(a in CACHE_RAM_FLAGS for a in self.b.extra_args) else ["--cache-ram", "0"]
        return ["--slot-save-path", str(slot_dir()), *off]

    def cpu_memory(self) -> Optional[CpuMemoryModel]:
        if self.gpu_layers:  # its weights and KV cache on a GPU
            return None
        flags = [*self._cache_args(), *self.b.extra_args]  # what the launch argv holds about the prompt cache
        limit, why = cache_ram_bytes(flags)
        idle = "--no-cache-idle-slots" not in flags
        return CpuMemoryModel(
            "llamacpp", RUNTIME_BASE_BYTES, RUNTIME_SOURCE, limit,
            f"{why}; every request's state but those still in a slot "
            f"({'idle slots saved when a task starts' if idle else '--no-cache-idle-slots'}; "
            "tools/server/server-task.cpp)",
            runtime_per_vocab_bytes=RUNTIME_PER_VOCAB_BYTES, runtime_per_merge_bytes=RUNTIME_PER_MERGE_BYTES,
            runtime_per_slot_bytes=RUNTIME_PER_SLOT_BYTES, logs_buffers=True, saves_idle_slots=idle)

    @classmethod
    def logged_buffers(cls, log_text: str) -> Optional[ServerBuffers]:
        return logged_buffers(log_text)

    @property
    def threads(self) -> int:
        # the server's own CPUs by default (all but the load generator's; kvexp/core/placement.py)
        return self.b.threads or self.placement.server_threads

    server_timing_source = "llama-server's per-request timings"
    log_kept = r"print_timing: "  # each request's timings, in the server's own words (`slot print_timing: id 0 | ...`)

    def request_timing(self, timings: Optional[dict[str, float]],
                       output_tokens: Optional[int]) -> Optional[dict[str, Optional[float]]]:
        if not timings:
            return None
        tpot = timings.get("predicted_per_token_s")
        n, decode = timings.get("predicted_n"), timings.get("predicted_s")
        if tpot is None and n and n > 1 and decode is not None:
            tpot = decode / (n - 1)
        return {"tpot_s": tpot, "prefill_s": timings.get("prompt_s"), "cached_tokens": timings.get("cache_n")}

    async def reset_cache(self, session: aiohttp.ClientSession) -> Optional[str]:
        """Erase every slot's cached prompt (POST /slots/{id}?action=erase; launched with
        --slot-save-path, and --cache-ram 0 so that no host-RAM copy survives)."""
        async with session.get(self.base_url + "/slots") as r:
            r.raise_for_status()
            ids = [slot["id"] for slot in await answer_json(r, list, **SLOT_FIELDS)]
        erased = 0
        for i in ids:
            async with session.post(self.base_url + f"/slots/{i}?action=erase") as r:
                if r.status != 200:
                    raise BackendError(f"llama-server refused to erase slot {i}: HTTP {r.status} "
                                       f"{(await r.text())[:200]}")
                erased += (await answer_json(r, n_erased=int))["n_erased"]
        ram = "kept (backend.extra_args sets --cache-ram)" if any(
            a in CACHE_RAM_FLAGS for a in self.b.extra_args) else "off (--cache-ram 0)"
        return f"erased {len(ids)} slots ({erased} cached tokens); host-RAM prompt cache {ram}"

    def _exact_bytes(self, info: KVCacheInfo, log_text: str) -> None:
        """Replace the log's 0.01-MiB size by cells x layers x bytes per cell, with the KV width read
        from the GGUF the server serves, when the two agree within the log's rounding."""
        caches = kv_size_lines(log_text)
        if not caches or not self.model_path or info.capacity_tokens is None or info.bytes is None:
            return
        try:
            arch = modelinfo.arch_for(self.cfg.model, self.model_field, self.model_path)
        except (OSError, ValueError):
            return
        if arch.n_kv_heads is None or arch.head_dim is None:
            return
        width = int(arch.n_kv_heads * arch.head_dim)
        parts = [(info.capacity_tokens, int(caches[-1 if info.window_tokens is None else -2][2]))]
        if info.window_tokens is not None:
            parts.append((info.window_tokens, int(caches[-1][2])))
        sizes = [exact_kv_bytes(cells, layers, width, str(info.dtype_k), str(info.dtype_v)) for cells, layers in parts]
        exact = None if None in sizes else sum(sizes)  # type: ignore[arg-type]
        if exact is not None and abs(exact - info.bytes) <= 0.005 * MIB * len(parts) + 1:
            info.bytes = exact
            info.source.append("bytes: cells x layers x KV bytes per cell (KV width from the GGUF); the log's "
                               "MiB figure agrees to its 0.01 MiB")

    async def poll(self, session: aiohttp.ClientSession) -> TelemetrySample:
        sample = TelemetrySample()
        async with session.get(self.base_url + "/slots") as r:
            if r.status == 200:
                sample.kv_usage = slots_usage(await answer_json(r, list, **SLOT_FIELDS), self.spec.unified_kv)
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
