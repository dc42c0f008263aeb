"""KV-cache capacity planner: pure maths over a model's architecture, a KV dtype and a GPU.

The defaults are the reference planner's parameters: GiB = 2**30, gpu_memory_utilization 0.9,
a fixed overhead of 1.5 GiB (CUDA context, activations, graphs), vLLM block size 16, and its seven
model presets. The core formulas:

    kv_bytes_per_token = 2 (K and V) x n_layers x n_kv_heads x head_dim x bytes_per_element
    vLLM capacity      = floor((gpu_gib x util - weights_gib - overhead_gib) x 2**30 / kv_bytes_per_token),
                         rounded down to whole blocks
    llama.cpp          = `-c CTX` cells in total, shared by `-np N` slots (CTX/N each)
    Ollama             = OLLAMA_CONTEXT_LENGTH x OLLAMA_NUM_PARALLEL cells

Nothing here reads files or prints; `plan_table` is the one entry that resolves model files (through
modelinfo) before calling the pure functions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional

from kvexp.config import highest_concurrency

if TYPE_CHECKING:
    from kvexp.config import ExperimentConfig

GIB_BYTES = 1 << 30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_OVERHEAD_GIB = 1.5
DEFAULT_BLOCK_SIZE = 16
DEFAULT_DTYPE_BYTES = 2  # fp16/bf16 model weights; what vLLM's kv "auto" means for them
LLAMACPP_CONTEXT_MARGIN_TOKENS = 16  # kvexp's llama.cpp adapter: -c = slots x (prompt + output + 16)
VLLM_CONTEXT_MARGIN_TOKENS = 16  # conf/backend/vllm.yaml: --max-model-len = prompt + output + margin
OLLAMA_DEFAULT_PARALLEL = 1

# Bytes per KV element for every spelling kvexp's backends use. Block-quantised llama.cpp types store
# 32 elements in a block with one fp16 scale (q8_0: 32 + 2 = 34 bytes; q4_0: 16 + 2 = 18 bytes).
KV_BYTES_PER_ELEMENT: dict[str, float] = {
    "f32": 4.0, "fp32": 4.0, "float32": 4.0,
    "f16": 2.0, "fp16": 2.0, "float16": 2.0, "half": 2.0,
    "bf16": 2.0, "bfloat16": 2.0,
    "fp8": 1.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0, "fp8_inc": 1.0,
    "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32, "q4_1": 20 / 32, "q4_0": 18 / 32,
    "iq4_nl": 18 / 32,
}
AUTO_KV_DTYPE = "auto"  # vLLM: the model's own dtype

# Calibration keys group spellings that store the same thing.
_CANONICAL_KV = {
    "f32": "f32", "fp32": "f32", "float32": "f32",
    "f16": "fp16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "bf16": "fp16", "bfloat16": "fp16",
    "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "fp8_inc": "fp8",
}


@dataclass(frozen=True)
class ModelPreset:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    params_b: float


# The reference planner's presets (the `planner.models` block of the reference document).
PRESETS: dict[str, ModelPreset] = {
    "qwen2.5-7b": ModelPreset(28, 4, 128, 7.62),
    "qwen2.5-14b": ModelPreset(48, 8, 128, 14.7),
    "qwen2.5-32b": ModelPreset(64, 8, 128, 32.5),
    "qwen3-8b": ModelPreset(36, 8, 128, 8.19),
    "qwen3-14b": ModelPreset(40, 8, 128, 14.8),
    "llama-3.1-8b": ModelPreset(32, 8, 128, 8.03),
    "mistral-7b": ModelPreset(32, 8, 128, 7.25),
}


@dataclass(frozen=True)
class ModelArch:
    """What the planner needs to know about a model; None where unknown.

    `sources` names where each number came from, e.g. {"n_layers": "config.json",
    "weights_gib": "files on disk"}; modelinfo.arch_from builds this from presets and model files."""

    n_layers: Optional[int] = None
    n_kv_heads: Optional[int] = None
    head_dim: Optional[float] = None  # (K + V head size) / 2 where they differ
    params_b: Optional[float] = None
    weights_gib: Optional[float] = None
    weight_bits: Optional[float] = None
    dtype_bytes: Optional[float] = None  # the model's compute dtype (what vLLM's kv "auto" stores)
    sources: Mapping[str, str] = field(default_factory=dict)
    name: Optional[str] = None
    context_length_tokens: Optional[int] = None  # the model's trained context, where known

    @classmethod
    def from_preset(cls, name: str, weights_gib: Optional[float] = None) -> "ModelArch":
        p = PRESETS[name]
        sources = {k: "preset" for k in ("n_layers", "n_kv_heads", "head_dim", "params_b")}
        if weights_gib is not None:
            sources["weights_gib"] = "preset"
        return cls(p.n_layers, p.n_kv_heads, p.head_dim, p.params_b, weights_gib, None, None,
                   sources, name)


# ---------------------------------------------------------------------------------------------------
# Elementary formulas


def kv_bytes_per_element(kv_dtype: str, dtype_bytes: Optional[float] = None) -> float:
    """Bytes per stored K or V element for a dtype spelling ("auto": the model dtype, 2 by default)."""
    key = kv_dtype.strip().lower()
    if key == AUTO_KV_DTYPE:
        return float(dtype_bytes or DEFAULT_DTYPE_BYTES)
    if key not in KV_BYTES_PER_ELEMENT:
        raise ValueError(f"kv dtype {kv_dtype!r}: unknown; known: auto, {', '.join(KV_BYTES_PER_ELEMENT)}")
    return KV_BYTES_PER_ELEMENT[key]


def canonical_kv_dtype(kv_dtype: str, dtype_bytes: Optional[float] = None) -> str:
    """The calibration key for a dtype spelling: 16-bit spellings (fp16, bf16, f16, vLLM "auto" on a
    16-bit model) share "fp16", fp8 variants share "fp8"; llama.cpp block types keep their name."""
    key = kv_dtype.strip().lower()
    if key == AUTO_KV_DTYPE:
        return "f32" if (dtype_bytes or DEFAULT_DTYPE_BYTES) >= 4 else "fp16"
    return _CANONICAL_KV.get(key, key)


def _num(x: float) -> float | int:
    """An integral float as int (JSON-friendly byte counts)."""
    return int(x) if float(x).is_integer() else x


def kv_bytes_per_token(n_layers: Optional[int], n_kv_heads: Optional[int], head_dim: Optional[float],
                       bytes_per_element: Optional[float]) -> Optional[float]:
    """2 (K and V) x layers x KV heads x head_dim x bytes per element; None if any input is unknown."""
    if None in (n_layers, n_kv_heads, head_dim, bytes_per_element):
        return None
    return _num(2 * n_layers * n_kv_heads * head_dim * bytes_per_element)  # type: ignore[operator]


def estimate_weights_gib(params_b: Optional[float], weight_bits: Optional[float]) -> Optional[float]:
    """params x bits / 8, in GiB."""
    if params_b is None or weight_bits is None:
        return None
    return params_b * 1e9 * weight_bits / 8 / GIB_BYTES


def blocks_per_request(request_tokens: int, block_size: Optional[int]) -> int:
    """vLLM blocks one request holds at its full length (a partly filled block counts whole)."""
    return math.ceil(request_tokens / block_size) if block_size else request_tokens


def vllm_capacity_tokens(gpu_gib: float, weights_gib: float, kv_bytes_per_token: float, *,
                         gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                         overhead_gib: float = DEFAULT_OVERHEAD_GIB,
                         block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """KV tokens vLLM can hold: the memory left under the utilisation cap, in whole blocks (>= 0)."""
    free_gib = gpu_gib * gpu_memory_utilization - weights_gib - overhead_gib
    return capacity_from_kv_bytes(free_gib * GIB_BYTES, kv_bytes_per_token, block_size)


def capacity_from_kv_bytes(kv_cache_bytes: float, kv_bytes_per_token: float, block_size: int) -> int:
    """Tokens that fit in a KV pool of this many bytes, in whole blocks (vLLM --kv-cache-memory-bytes)."""
    if kv_cache_bytes <= 0:
        return 0
    tokens = math.floor(kv_cache_bytes / kv_bytes_per_token)
    return tokens // block_size * block_size


def overhead_for_capacity(capacity_tokens: int, gpu_gib: float, weights_gib: float,
                          kv_bytes_per_token: float, *,
                          gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                          block_size: int = DEFAULT_BLOCK_SIZE) -> float:
    """The overhead (GiB) that makes `vllm_capacity_tokens` return exactly `capacity_tokens`.

    Every overhead whose free memory lands in [capacity, capacity + block) tokens does; this returns
    the middle of that interval so float rounding cannot tip the re-prediction into the next block."""
    target_tokens = capacity_tokens + block_size / 2
    return gpu_gib * gpu_memory_utilization - weights_gib - target_tokens * kv_bytes_per_token / GIB_BYTES


def max_context_tokens(gpu_gib: float, weights_gib: float, kv_bytes_per_token: float, *,
                       overhead_gib: float = DEFAULT_OVERHEAD_GIB, utilization: float = 1.0) -> int:
    """The most KV cells that fit beside the weights and overhead (llama.cpp -c; >= 0)."""
    free_gib = gpu_gib * utilization - weights_gib - overhead_gib
    return max(0, math.floor(free_gib * GIB_BYTES / kv_bytes_per_token))


def max_concurrency(capacity_tokens: int, request_tokens: int, block_size: Optional[int] = None) -> int:
    """Whole requests (prompt + output) the KV cache holds at once; vLLM counts whole blocks."""
    if block_size:
        return (capacity_tokens // block_size) // blocks_per_request(request_tokens, block_size)
    return capacity_tokens // request_tokens


def kv_usage(running: int, capacity_tokens: int, request_tokens: int,
             block_size: Optional[int] = None) -> Optional[float]:
    """min(1, running x request / capacity), in whole blocks where block_size is given."""
    if capacity_tokens <= 0:
        return None
    if block_size:
        used = running * blocks_per_request(request_tokens, block_size)
        return min(1.0, used / (capacity_tokens // block_size))
    return min(1.0, running * request_tokens / capacity_tokens)


def ollama_default_context_tokens(gpu_gib: Optional[float], model_context_tokens: Optional[int] = None) -> int:
    """Ollama's default OLLAMA_CONTEXT_LENGTH by VRAM: < 24 GiB 4k, 24-48 GiB 32k, >= 48 GiB 256k
    (capped at the model's own context where known)."""
    if gpu_gib is None or gpu_gib < 24:
        ctx = 4096
    elif gpu_gib < 48:
        ctx = 32768
    else:
        ctx = 262144
    return min(ctx, model_context_tokens) if model_context_tokens else ctx


def _gib(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 4)


# ---------------------------------------------------------------------------------------------------
# The per-job planner block


LLAMACPP_CELL_PAD = 256


def llamacpp_cells_per_slot(context_tokens: int, slots: int) -> int:
    """KV cells llama-server gives each slot for `-c context -np slots`: each slot's share, padded up
    to a multiple of 256 (seen on the real server: -c 128 -np 2 gives 2 x 256 cells, -c 4096 -np 3
    gives 3 x 1536)."""
    share = max(1, context_tokens // max(1, slots))
    return -(-share // LLAMACPP_CELL_PAD) * LLAMACPP_CELL_PAD


def plan_job(arch: ModelArch, kv_dtype: str, backend: str, gpu_gib: float | None, *,
             prompt_tokens: int, max_tokens: int, levels: list[int],
             gpu_memory_utilization: float | None = None, context: int | None = None,
             parallel: int | None = None, block_size: int | None = None,
             overhead_gib: float | None = None, calibrated_overhead_gib: float | None = None,
             kv_cache_memory_bytes: int | None = None) -> dict[str, Any]:
    """The JSON-ready planner block of one job. Keys (stable; None where unknown):

    kv_bytes_per_element, kv_bytes_per_token
    capacity_tokens    vLLM: KV pool in tokens (blocks x block_size; None when the GPU size is
                       unknown and no kv_cache_memory_bytes); llama.cpp: -c cells; Ollama: ctx x parallel
    blocks, block_size vLLM only (None elsewhere)
    kv_cache_bytes     capacity_tokens x kv_bytes_per_token
    context_per_slot_tokens  longest sequence one slot/request may reach (vLLM: max_model_len or capacity)
    slots              llama.cpp -np / OLLAMA_NUM_PARALLEL / vLLM max_num_seqs (None: not limited)
    predicted_peak_memory_gib  weights + KV cache + overhead
    max_context_that_fits  vLLM: capacity_tokens; llama.cpp: the largest -c that fits the GPU;
                       Ollama: the largest OLLAMA_CONTEXT_LENGTH that fits with its parallel slots
    fits               the configuration fits the GPU (vLLM: capacity > 0 and max_model_len fits)
    request_tokens     prompt_tokens + max_tokens
    request_fits       a whole request fits one sequence's context
    max_concurrency_before_preemption  vLLM: whole requests the block pool holds; None for
                       llama.cpp/Ollama, which never preempt (extra requests wait for a slot)
    max_concurrent_requests  requests served at once before the rest queue
    levels             [{concurrency, predicted_kv_usage (0..1), predicts_preemption, predicts_queueing}]
    calibrated         None, or {overhead_gib, and the capacity keys above recomputed with the fitted
                       overhead: capacity_tokens, blocks, kv_cache_bytes, predicted_peak_memory_gib,
                       max_context_that_fits, fits, max_concurrency_before_preemption,
                       max_concurrent_requests, levels}
    inputs             every number the block was computed from
    sources            where each input came from (the model's `sources` plus "argument"/"default")
    """
    backend = backend.strip().lower()
    if backend not in ("vllm", "llamacpp", "ollama"):
        raise ValueError(f"backend {backend!r}: allowed values are vllm, llamacpp, ollama")
    sources: dict[str, str] = dict(arch.sources)

    def given(name: str, value: Any, default: Any, default_source: str = "default") -> Any:
        sources[name] = "argument" if value is not None else default_source
        return value if value is not None else default

    bpe = kv_bytes_per_element(kv_dtype, arch.dtype_bytes)
    bpt = kv_bytes_per_token(arch.n_layers, arch.n_kv_heads, arch.head_dim, bpe)
    overhead = given("overhead_gib", overhead_gib, DEFAULT_OVERHEAD_GIB, "default (reference planner)")
    request_tokens = prompt_tokens + max_tokens
    weights = arch.weights_gib
    util = bs = None
    if backend == "vllm":
        util = given("gpu_memory_utilization", gpu_memory_utilization, DEFAULT_GPU_MEMORY_UTILIZATION,
                     "default (reference planner)")
        bs = given("block_size", block_size, DEFAULT_BLOCK_SIZE, "default (vLLM on GPU)")
        slots = parallel
        sources["parallel"] = "argument" if parallel is not None else "not limited"
        model_ctx = context if context is not None else arch.context_length_tokens
        sources["context_tokens"] = ("argument" if context is not None else
                                     "model's context length" if model_ctx is not None else "unknown")
    elif backend == "llamacpp":
        slots = given("parallel", parallel, 1)
        model_ctx = given("context_tokens", context, arch.context_length_tokens,
                          "model's context length (-c 0)")
    else:
        slots = given("parallel", parallel, OLLAMA_DEFAULT_PARALLEL, "Ollama default")
        model_ctx = given("context_tokens", context,
                          ollama_default_context_tokens(gpu_gib, arch.context_length_tokens),
                          "Ollama default for this VRAM")
    if gpu_gib is not None:
        sources.setdefault("gpu_gib", "argument")

    def capacity_fields(ovh: float) -> dict[str, Any]:
        cap = per_slot = peak = max_ctx = fits = None
        if bpt is not None and backend == "vllm":
            if kv_cache_memory_bytes is not None:
                cap = capacity_from_kv_bytes(kv_cache_memory_bytes, bpt, bs)
            elif gpu_gib is not None and weights is not None:
                cap = vllm_capacity_tokens(gpu_gib, weights, bpt, gpu_memory_utilization=util,
                                           overhead_gib=ovh, block_size=bs)
            if cap is not None:
                max_ctx = cap
                per_slot = min(model_ctx, cap) if model_ctx is not None else cap
                fits = cap > 0 and (model_ctx is None or model_ctx <= cap)
        elif bpt is not None and model_ctx is not None:
            if backend == "llamacpp":
                per_slot = llamacpp_cells_per_slot(model_ctx, slots)
                cap = per_slot * slots
            else:
                cap, per_slot = model_ctx * slots, model_ctx
            if gpu_gib is not None and weights is not None:
                max_ctx = max_context_tokens(gpu_gib, weights, bpt, overhead_gib=ovh)
                if backend == "ollama":
                    max_ctx //= slots
        kv_bytes = None if cap is None or bpt is None else _num(cap * bpt)
        if kv_bytes is not None and weights is not None:
            peak = weights + kv_bytes / GIB_BYTES + ovh
            if gpu_gib is not None and (backend != "vllm" or kv_cache_memory_bytes is not None):
                fits = peak <= gpu_gib and fits is not False
        request_fits = None if per_slot is None else request_tokens <= per_slot
        max_pre = max_req = None
        if cap is not None and request_fits is not None:
            if backend == "vllm":
                max_pre = max_concurrency(cap, request_tokens, bs) if request_fits else 0
                max_req = max_pre if slots is None else min(max_pre, slots)
            else:
                max_req = slots if request_fits else 0
        rows = []
        for c in levels:
            running = c if slots is None else min(c, slots)
            usage = None if cap is None else kv_usage(running, cap, request_tokens, bs)
            rows.append({
                "concurrency": c,
                "predicted_kv_usage": None if usage is None else round(usage, 4),
                "predicts_preemption": (None if backend == "vllm" and max_pre is None
                                        else backend == "vllm" and running > max_pre),
                "predicts_queueing": None if max_req is None else c > max_req,
            })
        return {
            "capacity_tokens": cap,
            "blocks": None if cap is None or bs is None else cap // bs,
            "kv_cache_bytes": kv_bytes,
            "context_per_slot_tokens": per_slot,
            "predicted_peak_memory_gib": _gib(peak),
            "max_context_that_fits": max_ctx,
            "fits": fits,
            "request_fits": request_fits,
            "max_concurrency_before_preemption": max_pre,
            "max_concurrent_requests": max_req,
            "levels": rows,
        }

    main = capacity_fields(overhead)
    calibrated = None
    if calibrated_overhead_gib is not None:
        cal = capacity_fields(calibrated_overhead_gib)
        calibrated = {"overhead_gib": _gib(calibrated_overhead_gib),
                      **{k: v for k, v in cal.items()
                         if k not in ("context_per_slot_tokens", "request_fits")}}
        sources["calibrated_overhead_gib"] = "calibration file"
    return {
        "kv_bytes_per_element": bpe,
        "kv_bytes_per_token": bpt,
        "capacity_tokens": main["capacity_tokens"],
        "blocks": main["blocks"],
        "block_size": bs,
        "kv_cache_bytes": main["kv_cache_bytes"],
        "context_per_slot_tokens": main["context_per_slot_tokens"],
        "slots": slots,
        "predicted_peak_memory_gib": main["predicted_peak_memory_gib"],
        "max_context_that_fits": main["max_context_that_fits"],
        "fits": main["fits"],
        "request_tokens": request_tokens,
        "request_fits": main["request_fits"],
        "max_concurrency_before_preemption": main["max_concurrency_before_preemption"],
        "max_concurrent_requests": main["max_concurrent_requests"],
        "levels": main["levels"],
        "calibrated": calibrated,
        "inputs": {
            "backend": backend,
            "kv_dtype": kv_dtype,
            "model": arch.name,
            "n_layers": arch.n_layers,
            "n_kv_heads": arch.n_kv_heads,
            "head_dim": arch.head_dim,
            "params_b": arch.params_b,
            "weights_gib": weights,
            "weight_bits": arch.weight_bits,
            "dtype_bytes": arch.dtype_bytes,
            "gpu_gib": gpu_gib,
            "gpu_memory_utilization": util,
            "overhead_gib": overhead,
            "calibrated_overhead_gib": calibrated_overhead_gib,
            "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "context_tokens": model_ctx,
            "parallel": slots,
            "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens,
        },
        "sources": sources,
    }


def reference_planner_block(kv_dtypes: tuple[str, ...] = ("auto", "fp8")) -> dict[str, Any]:
    """The planner parameters in the reference document's `planner` shape (for aggregates)."""
    return {
        "gib": GIB_BYTES,
        "kv_bytes": {k: kv_bytes_per_element(k) for k in kv_dtypes},
        "gpu_memory_utilization": DEFAULT_GPU_MEMORY_UTILIZATION,
        "overhead_gib": DEFAULT_OVERHEAD_GIB,
        "block_size": DEFAULT_BLOCK_SIZE,
        "models": {name: {"n_layers": p.n_layers, "n_kv_heads": p.n_kv_heads,
                          "head_dim": p.head_dim, "params_b": p.params_b}
                   for name, p in PRESETS.items()},
    }


# ---------------------------------------------------------------------------------------------------
# From typed configs


def scenario_levels(cfg: "ExperimentConfig") -> list[int]:
    """Concurrency levels of the scenario (an open-loop scenario: its max_concurrency cap, if any)."""
    s = cfg.scenario
    if s.concurrency:
        return [int(c) for c in s.concurrency]
    return [int(s.max_concurrency)] if s.max_concurrency else []


def backend_context_parallel(cfg: "ExperimentConfig") -> tuple[Optional[int], Optional[int]]:
    """(context, parallel) as kvexp launches the backend (conf/backend/*.yaml); None: its default.

    parallel (llama.cpp -np, vLLM --max-num-seqs, OLLAMA_NUM_PARALLEL): backend.parallel, else the
    scenario's highest concurrency. context: backend.context, else llama.cpp parallel x (prompt +
    output + 16) (kvexp's adapter), vLLM prompt + output + margin, Ollama OLLAMA_CONTEXT_LENGTH from
    backend.env or Ollama's own default."""
    b, s = cfg.backend, cfg.scenario
    env = b.env or {}
    highest = highest_concurrency(s)
    request = s.prompt_tokens + s.max_tokens
    if b.name == "llamacpp":
        parallel = b.parallel or highest
        return b.context or parallel * (request + LLAMACPP_CONTEXT_MARGIN_TOKENS), parallel
    if b.name == "ollama":
        parallel = b.parallel or _int_or_none(env.get("OLLAMA_NUM_PARALLEL")) or highest
        return b.context or _int_or_none(env.get("OLLAMA_CONTEXT_LENGTH")), parallel
    return b.context or request + VLLM_CONTEXT_MARGIN_TOKENS, b.parallel or highest


def _int_or_none(x: Any) -> Optional[int]:
    try:
        return int(x) if x not in (None, "") else None
    except (TypeError, ValueError):
        return None


def plan_for_config(cfg: "ExperimentConfig", arch: ModelArch, *, gpu_gib: Optional[float] = None,
                    calibrated_overhead_gib: Optional[float] = None) -> dict[str, Any]:
    """plan_job for one ExperimentConfig (gpu_gib: a measured size overrides cfg.gpu.memory_gib)."""
    b = cfg.backend
    kv_dtype = cfg.kv.per_backend.get(b.name) or cfg.kv.name
    context, parallel = backend_context_parallel(cfg)
    gpu = gpu_gib if gpu_gib is not None else cfg.gpu.memory_gib
    plan = plan_job(
        arch, kv_dtype, b.name, gpu,
        prompt_tokens=cfg.scenario.prompt_tokens, max_tokens=cfg.scenario.max_tokens,
        levels=scenario_levels(cfg),
        gpu_memory_utilization=getattr(b, "gpu_memory_utilization", None),
        context=context, parallel=parallel, block_size=getattr(b, "block_size", None),
        calibrated_overhead_gib=calibrated_overhead_gib,
        kv_cache_memory_bytes=getattr(b, "kv_cache_memory_bytes", None),
    )
    src = plan["sources"]
    for key, value in (("gpu_memory_utilization", getattr(b, "gpu_memory_utilization", None)),
                       ("block_size", getattr(b, "block_size", None))):
        if value is not None:
            src[key] = f"backend.{key}"
    if gpu is not None:
        src["gpu_gib"] = "measured" if gpu_gib is not None else "gpu config"
    src["parallel"] = "backend.parallel" if b.parallel else "derived: highest concurrency level"
    if b.context:
        src["context_tokens"] = "backend.context"
    elif b.name == "llamacpp":
        src["context_tokens"] = "derived: parallel x (prompt + output + 16)"
    elif b.name == "vllm":
        src["context_tokens"] = "derived: prompt + output + 16"
    return plan


def resolve_arch(cfg: "ExperimentConfig", model_path: Optional[str] = None) -> ModelArch:
    """The model's architecture for this backend: preset merged with its files (reads config.json
    or the GGUF header through modelinfo when they are on disk). model_path: the path the backend
    actually serves, if known."""
    from pathlib import Path

    from kvexp import modelinfo

    if model_path:
        p = Path(model_path).expanduser()
        if p.exists():
            return modelinfo.arch_from(cfg.model, p)
    return modelinfo.arch_for_backend(cfg.model, cfg.backend.name)


def plan_for_job(cfg: "ExperimentConfig", *, model_path: Optional[str] = None,
                 gpu_name: Optional[str] = None, gpu_gib: Optional[float] = None,
                 calibration: Optional[Mapping[str, Any]] = None,
                 arch: Optional[ModelArch] = None) -> dict[str, Any]:
    """The planner block for a job (what the runner stores as result["planner"]): resolves the
    architecture (unless `arch` is given) and the calibrated overhead for (backend, GPU, KV dtype)
    from a loaded calibration table, then calls plan_job. gpu_name / gpu_gib: measured values that
    override cfg.gpu."""
    from kvexp.calibration import lookup_overhead_gib

    arch = arch or resolve_arch(cfg, model_path)
    kv_dtype = cfg.kv.per_backend.get(cfg.backend.name) or cfg.kv.name
    cal = lookup_overhead_gib(calibration, cfg.backend.name, gpu_name or cfg.gpu.name,
                              canonical_kv_dtype(kv_dtype, arch.dtype_bytes))
    return plan_for_config(cfg, arch, gpu_gib=gpu_gib, calibrated_overhead_gib=cal)


def _fmt_int(x: Any) -> str:
    return "-" if x is None else f"{x:,}"


def _fmt_levels(rows: list[dict[str, Any]]) -> str:
    out = []
    for r in rows:
        u = r["predicted_kv_usage"]
        tag = "" if u is None else f" {u:.0%}" if u >= 0.1 or u == 0 else f" {u:.1%}"
        if r["predicts_preemption"]:
            tag += " preempts"
        elif r["predicts_queueing"]:
            tag += " queues"
        out.append(f"{r['concurrency']}: {tag.strip() or '?'}")
    return ", ".join(out) or "-"


def plan_table(cfgs: list["ExperimentConfig"], calibration: dict | None) -> str:
    """A Markdown table of the plan for each config: bytes/token, capacity, blocks, the largest
    concurrency before preemption and the predicted KV usage per level, uncalibrated and calibrated.

    Resolves each model's architecture first (modelinfo may read config.json / GGUF headers)."""
    archs: dict[tuple[str, str], ModelArch] = {}
    lines = [
        "| model | backend | kv | scenario | bytes/token | capacity tokens | blocks | peak GiB | max conc. | "
        "levels (KV usage) | cal. overhead GiB | cal. capacity | cal. max conc. | cal. levels |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    notes: list[str] = []
    for cfg in cfgs:
        key = (cfg.model.name, cfg.backend.name)
        if key not in archs:
            archs[key] = resolve_arch(cfg)
        kv_dtype = cfg.kv.per_backend.get(cfg.backend.name)
        head = f"| {cfg.model.name} | {cfg.backend.name} | {kv_dtype or cfg.kv.name} | {cfg.scenario.name} "
        if kv_dtype is None:
            lines.append(head + f"| kv={cfg.kv.name} is not available on {cfg.backend.name} |" + " |" * 9)
            continue
        try:
            p = plan_for_job(cfg, calibration=calibration, arch=archs[key])
        except ValueError as e:
            lines.append(head + f"| {e} |" + " |" * 9)
            continue
        max_conc = (p["max_concurrency_before_preemption"] if cfg.backend.name == "vllm"
                    else p["max_concurrent_requests"])
        c = p["calibrated"]
        c_conc = None if c is None else (c["max_concurrency_before_preemption"]
                                         if cfg.backend.name == "vllm" else c["max_concurrent_requests"])
        peak = p["predicted_peak_memory_gib"]
        peak_s = "-" if peak is None else f"{peak:.2f}" + (" (does not fit)" if p["fits"] is False else "")
        lines.append(
            head + f"| {_fmt_int(p['kv_bytes_per_token'])} | {_fmt_int(p['capacity_tokens'])} "
            f"| {_fmt_int(p['blocks'])} | {peak_s} | {_fmt_int(max_conc)} | {_fmt_levels(p['levels'])} "
            f"| {'-' if c is None else c['overhead_gib']} "
            f"| {'-' if c is None else _fmt_int(c['capacity_tokens'])} | {_fmt_int(c_conc)} "
            f"| {'-' if c is None else _fmt_levels(c['levels'])} |")
        srcs = ", ".join(f"{k}: {v}" for k, v in sorted(p["sources"].items()))
        inp = p["inputs"]
        weights = "?" if inp["weights_gib"] is None else f"{inp['weights_gib']:.3f}"
        note = (f"- {cfg.model.name}/{cfg.backend.name}: GPU {cfg.gpu.name or '?'} "
                f"{'?' if inp['gpu_gib'] is None else inp['gpu_gib']} GiB, weights {weights} GiB, "
                f"overhead {inp['overhead_gib']} GiB; sources: {srcs}")
        if note not in notes:
            notes.append(note)
    legend = ("max conc.: vLLM requests before preemption; llama.cpp/Ollama requests served at once "
              "(more queue). Levels: concurrency: predicted KV usage.")
    return "\n".join(lines + ["", legend, ""] + notes) + "\n"
