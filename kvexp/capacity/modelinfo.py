"""Model architecture for the planner, read from the model itself where it is on disk.

Sources, in order of trust: a Hugging Face `config.json` or a GGUF header (kvexp/capacity/gguffile.py: only
metadata and tensor shapes are read, once per file), the sizes of the weight files on disk, the
ModelConfig preset ("preset"), the planner's built-in presets, and finally an estimate
(params x bits / 8). Every number carries its source in `ModelArch.sources`.

The `*_fields` functions are pure (dict in, dict out); the `read_*` functions do the I/O."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Optional

from kvexp.assets import embedded
from kvexp.capacity import gguffile
from kvexp.capacity.planner import DEFAULT_DTYPE_BYTES, GIB_BYTES, PRESETS, ModelArch, estimate_weights_gib
from kvexp.core.config import ModelConfig

__all__ = ["ModelArch", "arch_from", "arch_for", "model_files", "hf_config_fields",
           "gguf_fields", "read_hf_config", "read_gguf_fields", "weights_bytes_on_disk", "preset_conflicts",
           "architecture_of", "hub_download"]

ARCH_KEYS = ("n_layers", "n_kv_heads", "head_dim", "params_b", "weight_bits", "dtype_bytes",
             "context_length_tokens", "sliding_window", "sliding_layers", "vocab_size", "vocab_merges")

# GGUF architectures whose sliding layers follow a period, as llama.cpp's loader sets them when the file
# names no `<arch>.attention.sliding_window_pattern` (src/models/<arch>.cpp: load_swa_pattern(ml, N)):
# in each period of N layers the last is global, the others slide (dense_first: the first is global).
GGUF_SWA_PERIOD = {"gemma2": (2, False), "gemma3": (6, False), "gemma-embedding": (6, False),
                   "cohere2": (4, False), "gpt-oss": (2, False), "exaone4": (4, False), "olmo2": (4, False)}
GGUF_DEFAULT_WINDOW = {"gemma2": 4096}  # llama.cpp's default where the file names no window

_DTYPE_BYTES = {"float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2, "float32": 4, "fp32": 4,
                "float": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_GGUF_SHARD = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


# ---------------------------------------------------------------------------------------------------
# Hugging Face config.json (pure)


def _first(cfg: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return None


def _quant_bits(q: dict[str, Any]) -> Optional[float]:
    """Weight bits from a quantization_config (AWQ/GPTQ `bits`, fp8, bitsandbytes, compressed-tensors)."""
    if q.get("bits") is not None:
        return float(q["bits"])
    method = str(q.get("quant_method") or "").lower()
    if "fp8" in method:
        return 8.0
    if q.get("load_in_4bit"):
        return 4.0
    if q.get("load_in_8bit"):
        return 8.0
    for group in (q.get("config_groups") or {}).values():
        bits = ((group or {}).get("weights") or {}).get("num_bits")
        if bits is not None:
            return float(bits)
    return None


def _estimate_params_b(c: dict[str, Any], n_layers: int, heads: int, kv_heads: int,
                       head_dim: float) -> Optional[float]:
    """Parameters of a dense decoder from its shapes (embeddings, attention, gated MLP); None for MoE."""
    hidden, inter, vocab = c.get("hidden_size"), c.get("intermediate_size"), c.get("vocab_size")
    if None in (hidden, inter, vocab) or any(c.get(k) for k in _EXPERT_KEYS):
        return None
    embed = vocab * hidden * (1 if c.get("tie_word_embeddings") else 2)
    attn = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    mlp = 3 * hidden * inter
    return round((embed + n_layers * (attn + mlp + 2 * hidden) + hidden) / 1e9, 3)


def hf_config_fields(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(values, sources) for ARCH_KEYS from a parsed config.json (a multimodal model's text_config
    wins over the top level)."""
    c = {**cfg, **(cfg.get("text_config") or {})}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    src = "config.json"

    def put(key: str, value: Any, how: str = src) -> None:
        if value is not None:
            values[key] = value
            sources[key] = how

    layers = _first(c, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(c, "num_attention_heads", "n_head")
    kv = _first(c, "num_key_value_heads", "num_kv_heads", "n_head_kv")
    kv_how = src
    if kv is None and c.get("multi_query"):
        kv = 1
    if kv is None and heads is not None:
        kv, kv_how = heads, "config.json (num_attention_heads: no num_key_value_heads)"
    head_dim = c.get("head_dim")
    hd_how = src
    if head_dim is None and heads and c.get("hidden_size"):
        head_dim, hd_how = c["hidden_size"] // heads, "config.json (hidden_size / num_attention_heads)"
    put("n_layers", layers)
    put("n_kv_heads", kv, kv_how)
    put("head_dim", head_dim, hd_how)
    dtype = _first(c, "torch_dtype", "dtype")
    if isinstance(dtype, str):
        put("dtype_bytes", _DTYPE_BYTES.get(dtype.lower().replace("torch.", "")))
        sources["weights_format"] = dtype.lower().replace("torch.", "")
    quant = c.get("quantization_config") or cfg.get("quantization_config")
    if isinstance(quant, dict):
        put("weight_bits", _quant_bits(quant), "config.json quantization_config")
        if quant.get("quant_method"):
            sources["weights_format"] = str(quant["quant_method"])
    elif "dtype_bytes" in values:
        put("weight_bits", values["dtype_bytes"] * 8, "config.json dtype")
    put("context_length_tokens", _first(c, "max_position_embeddings", "n_positions", "max_seq_len"))
    put("vocab_size", c.get("vocab_size") if isinstance(c.get("vocab_size"), int) else None)
    window, sliding, how = _hf_window(c, layers)
    put("sliding_window", window, how)
    put("sliding_layers", sliding, how)
    if None not in (layers, heads, kv, head_dim):
        put("params_b", _estimate_params_b(c, layers, heads, kv, head_dim),
            "config.json (estimated from layer shapes)")
    return values, sources


def _hf_window(c: dict[str, Any], layers: Optional[int]) -> tuple[Optional[int], Optional[int], str]:
    """(sliding window, sliding layers, source) from a config.json: `layer_types` names each layer
    ("sliding_attention"); else `sliding_window_pattern` N (every Nth layer global); else a window with
    `use_sliding_window` not false and no pattern slides every layer (Mistral v0.1). Qwen2's configs carry
    a window with use_sliding_window false: no window."""
    window = c.get("sliding_window")
    if not isinstance(window, int) or window <= 0 or c.get("use_sliding_window") is False:
        return None, None, "config.json"
    types = c.get("layer_types")
    if isinstance(types, list) and types:
        return window, sum(1 for t in types if "sliding" in str(t)), "config.json (sliding_window, layer_types)"
    pattern = c.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0 and layers:
        return window, sum(1 for il in range(layers) if (il + 1) % pattern), \
            "config.json (sliding_window, sliding_window_pattern)"
    return window, layers, "config.json (sliding_window on every layer)"


def _gguf_window(arch: str, get: Any, layers: Optional[int]) -> tuple[Optional[int], Optional[int], str]:
    """(sliding window, sliding layers, source) from a GGUF header, as llama.cpp's loader reads it."""
    window = get("attention.sliding_window")
    how = "gguf header"
    if window is None and arch in GGUF_DEFAULT_WINDOW:
        window, how = GGUF_DEFAULT_WINDOW[arch], f"llama.cpp's default window for {arch}"
    if not window or not layers:
        return None, None, how
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, (list, tuple)):
        return int(window), sum(1 for p in pattern[:layers] if p), how + " (sliding_window_pattern per layer)"
    period, dense_first = GGUF_SWA_PERIOD.get(arch, (0, False))
    if isinstance(pattern, int):
        period, how = pattern, how + " (sliding_window_pattern)"
    elif period:
        how += f" (llama.cpp's {arch} layer pattern: 1 global in {period})"
    else:
        return None, None, how + f" (a window, but llama.cpp gives {arch} no layer pattern: not planned)"
    if period == 0:
        return int(window), layers, how
    slides = (lambda il: il % period != 0) if dense_first else (lambda il: il % period < period - 1)
    return int(window), sum(1 for il in range(layers) if slides(il)), how


# ---------------------------------------------------------------------------------------------------
# GGUF header (pure part)


def gguf_fields(meta: dict[str, Any], n_params: Optional[int] = None,
                tensor_bytes: Optional[int] = None) -> tuple[dict[str, Any], dict[str, str]]:
    """(values, sources) for ARCH_KEYS from GGUF metadata (key -> value) and tensor totals."""
    src = "gguf header"
    arch = meta.get("general.architecture")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if not arch:
        return values, sources

    def get(name: str) -> Any:
        return meta.get(f"{arch}.{name}")

    def put(key: str, value: Any, how: str = src) -> None:
        if value is not None:
            values[key] = value
            sources[key] = how

    heads = get("attention.head_count")
    kv = get("attention.head_count_kv")
    kv_how = src
    if isinstance(heads, (list, tuple)):
        heads = max(heads) if heads else None
    if isinstance(kv, (list, tuple)):  # per-layer counts: the largest layer bounds the cache
        kv, kv_how = (max(kv) if kv else None), "gguf header (per-layer head_count_kv: max)"
    if kv is None and heads is not None:
        kv, kv_how = heads, "gguf header (head_count: no head_count_kv)"
    k_len, v_len = get("attention.key_length"), get("attention.value_length")
    embd = get("embedding_length")
    head_dim, hd_how = None, src
    if k_len is not None:
        head_dim = (k_len + (v_len if v_len is not None else k_len)) / 2
        head_dim = int(head_dim) if float(head_dim).is_integer() else head_dim
        if v_len is not None and v_len != k_len:
            hd_how = "gguf header ((key_length + value_length) / 2)"
    elif embd and heads:
        head_dim, hd_how = embd // heads, "gguf header (embedding_length / head_count)"
    put("n_layers", get("block_count"))
    put("n_kv_heads", kv, kv_how)
    put("head_dim", head_dim, hd_how)
    put("context_length_tokens", get("context_length"))
    window, sliding, how = _gguf_window(str(arch), get, get("block_count"))
    put("sliding_window", window, how)
    put("sliding_layers", sliding, how)
    if n_params:
        put("params_b", round(n_params / 1e9, 4), "gguf tensors")
        if tensor_bytes:
            put("weight_bits", round(tensor_bytes * 8 / n_params, 3), "gguf tensors")
    return values, sources


def gguf_file_type(meta: dict[str, Any]) -> Optional[str]:
    """general.file_type as a name (e.g. MOSTLY_Q4_K_M), where the gguf package knows it."""
    ft = meta.get("general.file_type")
    if ft is None:
        return None
    try:
        import gguf  # ~0.1 s to import (numpy): only when a GGUF's file type is named

        return gguf.LlamaFileType(int(ft)).name
    except (ImportError, ValueError):
        return str(ft)


# ---------------------------------------------------------------------------------------------------
# I/O


def read_hf_config(path: Path) -> dict[str, Any]:
    """config.json of a model directory (or the file itself)."""
    p = path / "config.json" if path.is_dir() else path
    with open(p, encoding="utf-8") as f:
        return json.load(f)


def read_gguf_fields(path: Path) -> tuple[dict[str, Any], int, int]:
    """(scalar metadata, total tensor elements, total tensor bytes) of a GGUF file's header (read in
    milliseconds and cached per file: kvexp/capacity/gguffile.py)."""
    h = gguffile.read_header(path)
    return {k: v for k, v in h.metadata.items() if not k.startswith("tokenizer.")}, h.n_params, h.n_bytes


def _gguf_shards(path: Path) -> list[Path]:
    m = _GGUF_SHARD.match(path.name)
    if not m:
        return [path]
    shards = sorted(path.parent.glob(f"{m.group(1)}-*-of-{m.group(3)}.gguf"))
    return shards or [path]


def weights_bytes_on_disk(path: Path) -> Optional[int]:
    """Bytes of the weight files: a .gguf (all shards of a split file), or a directory's *.safetensors
    (else *.bin); None when there are none."""
    if path.is_file():
        if path.suffix == ".gguf":
            return sum(p.stat().st_size for p in _gguf_shards(path))
        path = path.parent
    if not path.is_dir():
        return None
    for pattern in ("*.safetensors", "*.bin"):
        files = [p for p in path.glob(pattern) if p.is_file() and p.name != "training_args.bin"]
        if files:
            return sum(p.stat().st_size for p in files)
    ggufs = sorted(path.glob("*.gguf"))
    return sum(p.stat().st_size for p in _gguf_shards(ggufs[0])) if ggufs else None


def _hf_cache_snapshot(repo_id: str) -> Optional[Path]:
    """The local snapshot of a Hugging Face repo id in the hub cache, if it has a config.json."""
    if "/" not in repo_id or repo_id.startswith(("/", ".", "~")):
        return None
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"), "hub")
    root = Path(hub) / ("models--" + repo_id.replace("/", "--"))
    ref = root / "refs" / "main"
    candidates = []
    if ref.is_file():
        candidates.append(root / "snapshots" / ref.read_text().strip())
    if (root / "snapshots").is_dir():
        candidates += sorted((root / "snapshots").iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    return next((c for c in candidates if (c / "config.json").is_file()), None)


def model_files(model: ModelConfig, field: Optional[str]) -> Optional[Path]:
    """Where the model a backend serves lives on this machine, by the ModelConfig field the backend
    serves (its adapter's model_field): `hf` a directory (or its hub-cache snapshot), `gguf` a file;
    None when not on disk (other fields, e.g. an Ollama tag, name no file kvexp reads). field None:
    whichever the model has (gguf when it has only that)."""
    if field == "gguf" or (field is None and model.gguf and not model.hf):
        if embedded.is_embedded(model.gguf):
            p = embedded.gguf_path(model.gguf)
            return p if p is not None and p.is_file() else None
        p = Path(os.path.expanduser(model.gguf)) if model.gguf else None
        return p if p is not None and p.exists() else None
    if field in ("hf", None) and model.hf and not embedded.is_embedded(model.hf):
        p = Path(os.path.expanduser(model.hf))
        if p.exists():
            return p
        return _hf_cache_snapshot(model.hf)
    return None


def _read_files(files: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Architecture values from a model directory, a config.json or a .gguf file."""
    if files.is_dir() and (files / "config.json").is_file():
        return hf_config_fields(read_hf_config(files))
    if files.is_file() and files.name.endswith(".json"):
        return hf_config_fields(read_hf_config(files))
    gguf_path = files if files.is_file() else next(iter(sorted(files.glob("*.gguf"))), None)
    if gguf_path is not None and gguf_path.suffix == ".gguf":
        meta, n_params, n_bytes = read_gguf_fields(gguf_path)
        values, sources = gguf_fields(meta, n_params, n_bytes)
        header = gguffile.read_header(gguf_path)  # cached: read once
        for key, value, field in (("vocab_size", header.vocab_size, "tokens"),
                                  ("vocab_merges", header.merges, "merges")):
            if value is not None:
                values[key], sources[key] = value, f"gguf header (tokenizer.ggml.{field})"
        ft = gguf_file_type(meta)
        if ft is not None:
            sources["file_type"] = ft
            sources["weights_format"] = "GGUF " + ft.removeprefix("MOSTLY_")
        return values, sources
    return {}, {}


def arch_from(model: ModelConfig, files: Path | None, *, prefer_preset: bool = False) -> ModelArch:
    """Merge the model's files with its ModelConfig preset into a ModelArch.

    Files win over preset values (prefer_preset=True: the preset overrides); the planner's built-in
    table for the model's name fills what both lack. weights_gib: files on disk, else the preset's
    weights_gib, else params_b x weight_bits / 8 (weight_bits defaulting to the dtype's)."""
    file_vals, file_src = _read_files(files) if files is not None and files.exists() else ({}, {})
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    preset_vals = {k: getattr(model, k, None) for k in ("n_layers", "n_kv_heads", "head_dim",
                                                        "params_b", "weight_bits", "sliding_window",
                                                        "sliding_layers")}
    builtin = PRESETS.get(model.name)
    for key in ARCH_KEYS:
        f, p = file_vals.get(key), preset_vals.get(key)
        if p is not None and (f is None or prefer_preset):
            values[key], sources[key] = p, "preset"
            if f is not None and f != p:
                sources[key] = f"preset (files say {f})"
        elif f is not None:
            values[key], sources[key] = f, file_src.get(key, "files")
            if p is not None and p != f:
                sources[key] += f" (preset said {p})"
        elif builtin is not None and hasattr(builtin, key):
            values[key], sources[key] = getattr(builtin, key), "planner preset table"
    for key in ("file_type", "weights_format"):
        if key in file_src:
            sources[key] = file_src[key]

    on_disk = weights_bytes_on_disk(files) if files is not None and files.exists() else None
    if on_disk:
        weights, sources["weights_gib"] = on_disk / GIB_BYTES, "files on disk"
    elif model.weights_gib is not None:
        weights, sources["weights_gib"] = model.weights_gib, "preset"
    else:
        bits = values.get("weight_bits")
        how = "weight_bits"
        if bits is None:
            bits, how = (values.get("dtype_bytes") or DEFAULT_DTYPE_BYTES) * 8, "16-bit weights assumed"
            if values.get("dtype_bytes"):
                how = "dtype"
        weights = estimate_weights_gib(values.get("params_b"), bits)
        if weights is not None:
            sources["weights_gib"] = f"estimate: params_b x {bits:g} bits / 8 ({how})"
    return ModelArch(
        n_layers=values.get("n_layers"), n_kv_heads=values.get("n_kv_heads"),
        head_dim=values.get("head_dim"), params_b=values.get("params_b"), weights_gib=weights,
        weight_bits=values.get("weight_bits"), dtype_bytes=values.get("dtype_bytes"),
        sources=sources, name=model.name, context_length_tokens=values.get("context_length_tokens"),
        sliding_window=values.get("sliding_window"), sliding_layers=values.get("sliding_layers"),
        vocab_size=values.get("vocab_size"), vocab_merges=values.get("vocab_merges"),
    )


def weights_of(arch: ModelArch) -> dict[str, Any]:
    """What a result records of the weights a server runs: their format (GGUF's file type, a checkpoint's
    dtype or quantisation method), bits per weight over all tensors, parameters (None: not known)."""
    return {"weights_format": arch.sources.get("weights_format"), "bits_per_weight": arch.weight_bits,
            "params_b": arch.params_b}


def arch_for(model: ModelConfig, field: Optional[str], served: Optional[str] = None) -> ModelArch:
    """The architecture of the model a backend serves: preset merged with its files. served: the path
    the backend actually serves, if known (e.g. the tiny model kvexp wrote); else the files `field`
    names (see model_files)."""
    if served:
        p = Path(served).expanduser()
        if p.exists():
            return arch_from(model, p)
    return arch_from(model, model_files(model, field))


# ---------------------------------------------------------------------------------------------------
# A model named by its file alone: what its file says, what a result records, what a run would download

CHECKED_KEYS = ("n_layers", "n_kv_heads", "head_dim")  # a preset that disagrees with its file is another model
RECORDED_KEYS = ("n_layers", "n_kv_heads", "head_dim", "sliding_window", "sliding_layers", "context_length_tokens",
                 "params_b", "weights_gib")


def preset_conflicts(model: ModelConfig, field: Optional[str]) -> tuple[list[tuple[str, Any, Any, str]], Optional[Path]]:
    """The architecture numbers the ModelConfig gives that the served file contradicts: (key, the
    config's value, the file's value, the file's source) for CHECKED_KEYS, and the file read (None: no
    file on disk, nothing compared). The file's header is read (cached per file)."""
    files = model_files(model, field)
    if files is None or not files.exists():
        return [], None
    values, sources = _read_files(files)
    out = []
    for key in CHECKED_KEYS:
        given, read = getattr(model, key, None), values.get(key)
        if given is not None and read is not None and float(given) != float(read):
            out.append((key, given, read, sources.get(key, "files")))
    return out, files


def architecture_of(arch: ModelArch) -> dict[str, Any]:
    """What a result records of the model's architecture: each number the planner used, with where it
    came from (the GGUF header, config.json, the preset, an estimate)."""
    return {**{k: getattr(arch, k, None) for k in RECORDED_KEYS},
            "sources": {k: str(arch.sources[k]) for k in RECORDED_KEYS if k in arch.sources}}


def hub_download(model: ModelConfig, field: Optional[str]) -> Optional[str]:
    """The hub id a server would download when it starts: model.hf names a repository (not a local folder,
    not a model kvexp brings) that is not in the local Hugging Face cache; None: nothing to download."""
    hf = model.hf
    if field != "hf" or not hf or embedded.is_embedded(hf) or "/" not in hf or hf.startswith(("/", ".", "~")):
        return None
    if Path(os.path.expanduser(hf)).exists() or _hf_cache_snapshot(hf) is not None:
        return None
    return hf
