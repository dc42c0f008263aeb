"""KV-cache capacity planner: pure maths over a model's architecture, a KV dtype and a GPU.

The defaults are the reference planner's parameters: GiB = 2**30, gpu_memory_utilization 0.9,
a fixed overhead of 1.5 GiB (CUDA context, activations, graphs), vLLM block size 16, and its seven
model presets. The core formulas:

    kv_bytes_per_token = 2 (K and V) x n_layers x n_kv_heads x head_dim x bytes_per_element
    sliding-window models (Gemma 2/3, gpt-oss, Mistral v0.1): only the global layers keep every token;
                         each sliding layer keeps a window, sized by the server (`CacheModel.window_cells`),
                         so KV memory = a fixed part (the window) + a per-token part (the global layers)
    vLLM capacity      = floor((gpu_gib x util - weights_gib - overhead_gib) x 2**30 / kv_bytes_per_token),
                         rounded down to whole blocks
    llama.cpp          = `-c CTX` cells in total, shared by `-np N` slots (CTX/N each)
    Ollama             = OLLAMA_CONTEXT_LENGTH x OLLAMA_NUM_PARALLEL cells

Nothing here reads files, prints or knows a backend by name: a server's cache layout arrives as a
`CacheModel` (each adapter in kvexp/backends declares its own) and a launched server as the adapter's
resolved spec (`plan`). Reading model files lives in modelinfo.py, the calibration file in
calibration.py, the Markdown plan table in summary.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

GIB_BYTES = 1 << 30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_OVERHEAD_GIB = 1.5
DEFAULT_BLOCK_SIZE = 16
DEFAULT_DTYPE_BYTES = 2  # fp16/bf16 model weights; what vLLM's kv "auto" means for them

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
class CacheModel:
    """How a server lays out its KV cache, as far as the planner needs to know (declared by each
    adapter; the planner never asks which backend it is).

    paged: one pool of blocks sized from a memory budget and shared by all sequences; a sequence that
    does not fit is preempted (vLLM). Otherwise each slot has a fixed context and requests beyond the
    slots queue (llama.cpp, Ollama).
    context_per_slot: the context setting is per sequence (Ollama's OLLAMA_CONTEXT_LENGTH) rather than
    shared by all slots (llama.cpp's -c).
    cell_pad: each slot's cells are rounded up to a multiple of this (llama-server: 256).
    default_slots: sequences at once when nothing sets it (None: not limited).
    reserved_blocks: blocks of a paged pool that hold no request (vLLM's null block: its usage gauge
    is used / (blocks - 1), and requests preempt when those blocks are taken).
    default_context: the context when nothing sets it, from (GPU GiB, the model's own context);
    None: the model's own context.
    gpu_default_slots: the server's own cap on sequences at once on a given GPU when nothing sets it,
    from (GPU GiB, GPU name) (vLLM's max_num_seqs default); None: default_slots applies."""

    name: str
    paged: bool
    context_per_slot: bool = False
    cell_pad: int = 1
    default_slots: Optional[int] = 1
    default_context: Optional[Callable[[Optional[float], Optional[int]], int]] = None
    gpu_default_slots: Optional[Callable[[float, Optional[str]], int]] = None
    default_block_size: Optional[int] = None
    reserved_blocks: int = 0  # blocks of the pool no request can use (vLLM keeps one null block)
    shares_prefixes: bool = False  # paged: running requests share the full blocks of a common prefix
    # slots: the cells the sliding-window layers keep in all streams together, from (window, each
    # stream's cells, slots, unified); None: the planner does not know how this server sizes a window,
    # and plans every layer as global
    window_cells: Optional[Callable[[int, int, int, bool], int]] = None
    # context_per_slot: the slots share one cache of context x slots cells, padded once (Ollama's own
    # engine), rather than one padded share each (the llama.cpp runner)
    pad_whole: bool = False
    # paged: the blocks one sliding-window group holds for a request of n tokens, from (n, window, block
    # size), and how the layers share the pool's blocks: (global layers, sliding layers) -> (layers per
    # group, global groups, sliding groups); None: every layer planned as global
    window_blocks: Optional[Callable[[int, int, int], int]] = None
    hybrid_groups: Optional[Callable[[int, int], tuple[int, int, int]]] = None


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
    sliding_window: Optional[int] = None  # tokens a sliding-window layer attends to (None: no window)
    sliding_layers: Optional[int] = None  # how many of the layers slide (None or 0: every layer is global)
    vocab_size: Optional[int] = None  # tokens of the tokenizer (a CPU server's RSS: kvexp/capacity/cpumemory.py)
    vocab_merges: Optional[int] = None  # a BPE tokenizer's merges (0 or None: none)

    @property
    def windowed(self) -> bool:
        return bool(self.sliding_window and self.sliding_layers)

    @property
    def global_layers(self) -> Optional[int]:
        """Layers that keep every token of the context."""
        if self.n_layers is None:
            return None
        return self.n_layers - (self.sliding_layers or 0) if self.windowed else self.n_layers

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


def kv_pair(kv_dtype: str) -> tuple[str, str]:
    """(K type, V type) of a spelling: "q8_0/q4_0" is a K/V pair (llama.cpp's -ctk/-ctv), "q8_0" both."""
    k, _, v = kv_dtype.partition("/")
    return k, (v or k)


def kv_bytes_per_element(kv_dtype: str, dtype_bytes: Optional[float] = None) -> float:
    """Bytes per stored K or V element for a dtype spelling ("auto": the model dtype, 2 by default). For a
    K/V pair ("q8_0/q4_0") the mean of K's and V's: every formula multiplies it by the K and V elements
    together (2 x layers x KV heads x head size per token), so K and V are each sized at their own type."""
    if "/" in kv_dtype:
        k, v = kv_pair(kv_dtype)
        return (kv_bytes_per_element(k, dtype_bytes) + kv_bytes_per_element(v, dtype_bytes)) / 2
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


def max_concurrency(capacity_tokens: int, request_tokens: int, block_size: Optional[int] = None,
                    shared_tokens: int = 0, groups: int = 1) -> int:
    """Whole requests (prompt + output) the KV cache holds at once; vLLM counts whole blocks, and holds
    the full blocks of a shared prefix (shared_tokens, one of `groups`) once per group."""
    if block_size:
        blocks, shared = capacity_tokens // block_size, shared_tokens // block_size
        own = blocks_per_request(request_tokens, block_size) - shared
        if shared and blocks >= groups * shared:  # every group's prefix is held: the rest is per request
            return max(min(groups, blocks // (own + shared)), (blocks - groups * shared) // own)
        return blocks // (own + shared)
    return capacity_tokens // request_tokens


def kv_usage(running: int, capacity_tokens: int, request_tokens: int,
             block_size: Optional[int] = None, shared_tokens: int = 0, groups: int = 1) -> Optional[float]:
    """min(1, running x request / capacity), in whole blocks where block_size is given. shared_tokens:
    a prefix of that many tokens, one of `groups`, that running requests share (prefix caching): its
    full blocks are held once per group in use, not once per request."""
    if capacity_tokens <= 0:
        return None
    if block_size:
        shared = shared_tokens // block_size
        used = running * (blocks_per_request(request_tokens, block_size) - shared) + min(groups, running) * shared
        return min(1.0, used / (capacity_tokens // block_size))
    return min(1.0, running * request_tokens / capacity_tokens)


def _gib(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 4)


# ---------------------------------------------------------------------------------------------------
# The per-job planner block


def _pad(n: int, pad: int) -> int:
    return -(-n // pad) * pad


def cells_per_slot(context_tokens: int, slots: int, pad: int = 1) -> int:
    """KV cells each of `slots` slots gets from a shared context, as llama-server sizes them: the
    context rounded up to a multiple of `pad`, split, each share rounded up again (-c 128 -np 2 gives
    2 x 256 cells, -c 3136 -np 4 gives 4 x 1024, -c 4096 -np 3 gives 3 x 1536)."""
    share = max(1, _pad(max(1, context_tokens), pad) // max(1, slots))
    return _pad(share, pad)


def plan_job(arch: ModelArch, kv_dtype: str, cache: CacheModel, gpu_gib: float | None, *,
             prompt_tokens: int, max_tokens: int, levels: list[int],
             gpu_memory_utilization: float | None = None, context: int | None = None,
             parallel: int | None = None, block_size: int | None = None,
             overhead_gib: float | None = None, calibrated_overhead_gib: float | None = None,
             kv_cache_memory_bytes: int | None = None, unified_kv: bool = False,
             shared_prefix_tokens: int = 0, prefix_groups: int = 1, tensor_parallel: int = 1) -> dict[str, Any]:
    """The JSON-ready planner block of one job (tensor_parallel GPUs of gpu_gib each split the weights and
    the KV cache: the pool is what all of them leave, each keeping its own overhead). Keys (stable; None
    where unknown):

    kv_bytes_per_element, kv_bytes_per_token  (a windowed model: the global layers' bytes, the per-token part)
    kv_window_bytes_per_token  the sliding layers' bytes per cell they keep (None: no window planned)
    kv_window_bytes_per_sequence  the fixed part: one sequence's whole window in the sliding layers
    sliding_window     the window the planner sized (None: no sliding layers, or a server whose window
                       sizing it does not know, when every layer is planned as global)
    window_tokens      cells the sliding layers keep in all streams (the fixed part; None: no window)
    capacity_tokens    paged (vLLM): KV pool in tokens (blocks x block_size; None when the GPU size is
                       unknown and no kv_cache_memory_bytes); slots: every slot's cells (llama.cpp -c
                       shared by the slots, each padded; one stream of -c cells with unified_kv;
                       Ollama: ctx x parallel)
    blocks, block_size vLLM only (None elsewhere)
    kv_cache_bytes     capacity_tokens x kv_bytes_per_token (+ window_tokens x kv_window_bytes_per_token)
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
    paged = cache.paged
    sources: dict[str, str] = dict(arch.sources)

    def given(name: str, value: Any, default: Any, default_source: str = "default") -> Any:
        sources[name] = "argument" if value is not None else default_source
        return value if value is not None else default

    bpe = kv_bytes_per_element(kv_dtype, arch.dtype_bytes)
    bpt = kv_bytes_per_token(arch.n_layers, arch.n_kv_heads, arch.head_dim, bpe)
    # a window the server sizes as the planner knows: the sliding layers' bytes are a fixed part per
    # stream, and only the global layers' bytes grow with the context
    window = arch.sliding_window if arch.windowed and (
        cache.window_blocks if paged else cache.window_cells) is not None else None
    bpt_window = None
    if window is not None and bpt is not None:
        bpt_window = kv_bytes_per_token(arch.sliding_layers, arch.n_kv_heads, arch.head_dim, bpe)
        bpt = kv_bytes_per_token(arch.global_layers, arch.n_kv_heads, arch.head_dim, bpe)
        sources["sliding_window"] = arch.sources.get("sliding_window", "model")
    elif arch.windowed:
        sources["sliding_window"] = (f"{arch.sources.get('sliding_window', 'model')}; {cache.name}'s window "
                                     "sizing is not known to the planner: every layer planned as global")
    overhead = given("overhead_gib", overhead_gib, DEFAULT_OVERHEAD_GIB, "default (reference planner)")
    request_tokens = prompt_tokens + max_tokens
    # prefix caching holds a shared prefix once per group (paged caches that share blocks)
    shared = shared_prefix_tokens if paged and cache.shares_prefixes else 0
    weights = arch.weights_gib
    util = bs = None
    if paged:
        util = given("gpu_memory_utilization", gpu_memory_utilization, DEFAULT_GPU_MEMORY_UTILIZATION,
                     "default (reference planner)")
        bs = given("block_size", block_size, cache.default_block_size or DEFAULT_BLOCK_SIZE,
                   f"default ({cache.name})")
    slots = given("parallel", parallel, cache.default_slots,
                  f"{cache.name} default" if cache.default_slots else "not limited")
    if context is not None or cache.default_context is None:
        model_ctx = given("context_tokens", context, arch.context_length_tokens, "model's context length")
    else:
        model_ctx = given("context_tokens", None, cache.default_context(gpu_gib, arch.context_length_tokens),
                          f"{cache.name} default for this GPU")
    if gpu_gib is not None:
        sources.setdefault("gpu_gib", "argument")
    tp = max(1, int(tensor_parallel or 1))
    gpus_gib = None if gpu_gib is None else gpu_gib * tp  # every GPU's memory, the weights split over them
    if tp > 1:
        sources.setdefault("tensor_parallel", "argument")

    def window_tokens(per_stream: int, slots_: int, unified: bool) -> int:
        """Cells the sliding layers keep in all streams (0 without a window)."""
        if window is None or cache.window_cells is None:
            return 0
        return cache.window_cells(window, per_stream, slots_, unified)

    groups = None  # paged with a window: (layers per group, global groups, sliding groups)
    if paged and window is not None and cache.hybrid_groups is not None:
        groups = cache.hybrid_groups(int(arch.global_layers), int(arch.sliding_layers))  # type: ignore[arg-type]

    def request_blocks(n: int) -> int:
        """Blocks one request of n tokens holds in every group of a paged pool."""
        own = blocks_per_request(n, bs)
        if groups is None or cache.window_blocks is None or window is None:
            return own
        return groups[1] * own + groups[2] * min(own, cache.window_blocks(n, window, int(bs)))  # type: ignore[arg-type]

    def capacity_fields(ovh: float) -> dict[str, Any]:
        cap = per_slot = peak = max_ctx = fits = None
        win = 0
        if bpt is not None and groups is not None:  # a hybrid pool: a block holds bs tokens of one group's layers
            budget = kv_cache_memory_bytes * tp if kv_cache_memory_bytes is not None else (
                None if gpus_gib is None or weights is None else (gpus_gib * util - weights - ovh) * GIB_BYTES)
            if budget is not None:
                per_layer = bpt / int(arch.global_layers)  # type: ignore[arg-type]
                cap = capacity_from_kv_bytes(budget, groups[0] * per_layer, bs)
                max_ctx = cap
                per_slot = min(model_ctx, cap) if model_ctx is not None else cap
                fits = cap > 0 and (model_ctx is None or request_blocks(model_ctx) <= cap // bs)
        elif bpt is not None and paged:
            if kv_cache_memory_bytes is not None:
                cap = capacity_from_kv_bytes(kv_cache_memory_bytes * tp, bpt, bs)  # a budget per GPU
            elif gpus_gib is not None and weights is not None:
                cap = vllm_capacity_tokens(gpus_gib, weights, bpt, gpu_memory_utilization=util,
                                           overhead_gib=ovh, block_size=bs)
            if cap is not None:
                max_ctx = cap
                per_slot = min(model_ctx, cap) if model_ctx is not None else cap
                fits = cap > 0 and (model_ctx is None or model_ctx <= cap)
        elif bpt is not None and model_ctx is not None:
            n = slots or 1
            if cache.context_per_slot and cache.pad_whole:  # one cache of ctx x n cells (Ollama's engine)
                per_slot, cap = model_ctx, _pad(model_ctx * n, cache.cell_pad)
            elif cache.context_per_slot:  # Ollama's runner asks llama.cpp for ctx x n cells, padded the same way
                per_slot = cells_per_slot(model_ctx * n, n, cache.cell_pad)
                cap = per_slot * n
            elif unified_kv:  # one stream of -c cells that any slot may fill
                cap = per_slot = cells_per_slot(model_ctx, 1, cache.cell_pad)
            else:
                per_slot = cells_per_slot(model_ctx, n, cache.cell_pad)
                cap = per_slot * n
            win = window_tokens(per_slot if cache.pad_whole else cap // (1 if unified_kv else n), n, unified_kv)
            if gpus_gib is not None and weights is not None:
                fixed = window_tokens(1 << 30, n, unified_kv) * (bpt_window or 0)  # the window, full
                max_ctx = max_context_tokens(gpus_gib, weights + fixed / GIB_BYTES, bpt, overhead_gib=ovh)
                if cache.context_per_slot:
                    max_ctx //= n
        if groups is not None:
            kv_bytes = None if cap is None or bpt is None else _num(cap * groups[0] * bpt / int(arch.global_layers))  # type: ignore[arg-type]
        else:
            kv_bytes = None if cap is None or bpt is None else _num(cap * bpt + win * (bpt_window or 0))
        if kv_bytes is not None and weights is not None:
            peak = weights + kv_bytes / GIB_BYTES + ovh
            if gpus_gib is not None and (not paged or kv_cache_memory_bytes is not None):
                fits = peak <= gpus_gib and fits is not False
        request_fits = None if per_slot is None else request_tokens <= per_slot
        max_pre = max_req = None
        usable = cap if cap is None or not paged else max(0, cap - cache.reserved_blocks * bs)
        if cap is not None and request_fits is not None:
            if groups is not None:  # every group's blocks come from the one pool
                max_pre = usable // bs // request_blocks(request_tokens) if request_fits else 0
                max_req = max_pre if slots is None else min(max_pre, slots)
            elif paged:
                max_pre = max_concurrency(usable, request_tokens, bs, shared, prefix_groups) if request_fits else 0
                max_req = max_pre if slots is None else min(max_pre, slots)
            elif unified_kv:  # the slots share one stream: as many whole requests as it holds
                max_req = min(slots or 1, cap // request_tokens) if request_fits else 0
            else:
                max_req = (slots or 1) if request_fits else 0
        rows = []
        for c in levels:
            running = c if slots is None else min(c, slots)
            if groups is not None:
                usage = None if cap is None or usable < bs else min(1.0, running * request_blocks(request_tokens)
                                                                    / (usable // bs))
            else:
                usage = None if cap is None else kv_usage(running, usable, request_tokens, bs, shared, prefix_groups)
            rows.append({
                "concurrency": c,
                "predicted_kv_usage": None if usage is None else round(usage, 4),
                "predicts_preemption": (None if paged and max_pre is None else paged and running > max_pre),
                "predicts_queueing": None if max_req is None else c > max_req,
            })
        return {
            "capacity_tokens": cap,
            "blocks": None if cap is None or bs is None else cap // bs,
            "kv_cache_bytes": kv_bytes,
            "window_tokens": win if window is not None and not paged else None,
            "context_per_slot_tokens": per_slot,
            "predicted_peak_memory_gib": _gib(peak),
            "max_context_that_fits": max_ctx,
            "fits": fits,
            "request_fits": request_fits,
            "max_concurrency_before_preemption": max_pre,
            "max_concurrent_requests": max_req,
            "levels": rows,
        }

    window_per_sequence = None  # the fixed part: the bytes of one sequence's full window
    if window is not None and bpt_window is not None:
        if groups is not None and cache.window_blocks is not None:
            window_per_sequence = _num(cache.window_blocks(1 << 30, window, int(bs)) * bs * bpt_window)  # type: ignore[arg-type]
        elif cache.window_cells is not None:
            window_per_sequence = _num(cache.window_cells(window, 1 << 30, 1, False) * bpt_window)
    main = capacity_fields(overhead * tp)
    calibrated = None
    if calibrated_overhead_gib is not None:
        cal = capacity_fields(calibrated_overhead_gib * tp)
        calibrated = {"overhead_gib": _gib(calibrated_overhead_gib),
                      **{k: v for k, v in cal.items()
                         if k not in ("context_per_slot_tokens", "request_fits", "window_tokens")}}
        sources["calibrated_overhead_gib"] = "calibration file"
    return {
        "kv_bytes_per_element": bpe,
        "kv_bytes_per_token": bpt,
        "kv_window_bytes_per_token": bpt_window,
        "kv_window_bytes_per_sequence": window_per_sequence,
        "sliding_window": window,
        "capacity_tokens": main["capacity_tokens"],
        "blocks": main["blocks"],
        "block_size": bs,
        "kv_cache_bytes": main["kv_cache_bytes"],
        "window_tokens": main["window_tokens"],
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
            "backend": cache.name,
            "kv_dtype": kv_dtype,
            "model": arch.name,
            "n_layers": arch.n_layers,
            "sliding_layers": arch.sliding_layers if arch.windowed else None,
            "model_sliding_window": arch.sliding_window if arch.windowed else None,
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
            "unified_kv": unified_kv,
            "context_tokens": model_ctx,
            "parallel": slots,
            "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens,
            "shared_prefix_tokens": shared_prefix_tokens,
            "prefix_groups": prefix_groups,
            "prefix_shared_in_cache": bool(shared),
            "tensor_parallel": tp,
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
