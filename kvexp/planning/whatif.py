"""What-if for other GPUs: how many tokens of KV cache, and how many concurrent requests of a
scenario, one configuration (model, backend, KV dtype) would get on each GPU of conf/gpu.

A what-if starts from a planner block's `inputs` (every number a prediction was computed from: the
architecture, the weights, the KV dtype, the scenario's request length, the backend's settings) and
re-plans them for another GPU's memory with planner.py's formulas:

- paged pools (vLLM): the KV pool the GPU's memory leaves (x utilisation - weights - overhead), in
  whole blocks, and the whole requests it holds before the scheduler preempts;
- fixed slots (llama.cpp, Ollama): the most KV cells that fit beside the weights and the overhead
  (the largest `-c`), and how many slots of one request each (padded as the server pads them) that is,
  at most the slots the configuration launches with (a server with 4 slots serves 4 requests at once on
  any GPU), before further requests queue.

The overhead is the reference planner's 1.5 GiB, and beside it the overhead this machine measured
(calibration.py's fitted table): for that GPU when it was measured there, else the mean of what was
fitted for the same backend and KV dtype on the GPUs that were measured (the row says which).

A KV budget that is the CPU build's default, and the CPU build's block size, describe this machine,
not the GPU asked about; they are replaced by the GPU defaults. Budgets and block sizes the user set
are kept. Pure: gpu_presets() is the only function that reads files."""

from __future__ import annotations

import math

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import yaml

from kvexp.capacity import planner
from kvexp.capacity.planner import CacheModel, ModelArch
from kvexp.core.paths import data_dir
from kvexp.planning.calibration import _norm, lookup_overhead_gib
from kvexp.results.blocks import Plan, PlanInputs

USER_SET = "backend."  # a source that starts with this was set by the user (backend.block_size, ...)


@dataclass(frozen=True)
class GPUPreset:
    """One GPU of conf/gpu: its file name (the `gpu=` option), NVML's name and memory in GiB."""

    key: str
    name: Optional[str]
    memory_gib: Optional[float]


def gpu_presets(conf_dir: Optional[Path] = None) -> list[GPUPreset]:
    """Every conf/gpu preset with a memory size (not `auto`), smallest memory first."""
    folder = (conf_dir or data_dir("conf")) / "gpu"
    out = []
    for p in sorted(folder.glob("*.yaml")):
        y = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        if isinstance(y.get("memory_gib"), (int, float)):
            out.append(GPUPreset(p.stem, y.get("name"), float(y["memory_gib"])))
    return sorted(out, key=lambda g: (g.memory_gib, g.key))


def parse_gpus(text: str, presets: Iterable[GPUPreset]) -> list[GPUPreset]:
    """`all` or a comma list of preset keys -> presets; ValueError naming an unknown key."""
    known = {g.key: g for g in presets}
    if text.strip().lower() == "all":
        return list(known.values())
    out = []
    for key in (k.strip() for k in text.split(",") if k.strip()):
        if key not in known:
            raise ValueError(f"--gpus {key}: no such GPU preset; allowed values are all, {', '.join(sorted(known))}")
        out.append(known[key])
    if not out:
        raise ValueError("--gpus: give `all` or a comma list of GPU presets")
    return out


# ---------------------------------------------------------------------------------------------------
# Calibration for another GPU (pure)


def overhead_for(table: Optional[Mapping[str, Any]], backend: str, gpu_name: Optional[str],
                 kv_dtype: str, dtype_bytes: Optional[float] = None) -> tuple[Optional[float], Optional[str]]:
    """(fitted overhead GiB, where it was measured) for a (backend, GPU, KV dtype): the GPU's own fit
    when there is one, else the mean of the same backend and KV dtype's fits on other GPUs; (None,
    None) when this machine measured neither."""
    kv = planner.canonical_kv_dtype(kv_dtype, dtype_bytes)
    own = lookup_overhead_gib(table, backend, gpu_name, kv)
    if own is not None:
        return own, gpu_name
    others = [e for e in (table or {}).get("entries") or []
              if _norm(e.get("backend")) == _norm(backend) and e.get("kv_dtype") == kv
              and isinstance(e.get("overhead_gib"), (int, float))]
    if not others:
        return None, None
    return (sum(e["overhead_gib"] for e in others) / len(others),
            ", ".join(sorted({str(e.get("gpu") or "unknown GPU") for e in others})))


# ---------------------------------------------------------------------------------------------------
# One configuration on one GPU (pure)


def _arch(inputs: PlanInputs) -> ModelArch:
    return ModelArch(inputs.n_layers, inputs.n_kv_heads, inputs.head_dim, inputs.params_b, inputs.weights_gib,
                     inputs.weight_bits, inputs.dtype_bytes, {}, inputs.model,
                     sliding_window=inputs.model_sliding_window, sliding_layers=inputs.sliding_layers)


def _user_set(sources: Mapping[str, str], key: str) -> bool:
    """Whether the user set this input (its source is a backend.* option)."""
    return str(sources.get(key, "")).startswith(USER_SET)


def _server_slots(inputs: PlanInputs, sources: Mapping[str, str], cache: CacheModel,
                  gpu: GPUPreset) -> Optional[int]:
    """Sequences a paged server runs at once on `gpu`: the user's backend.parallel, else the server's
    own default for that GPU (vLLM's max_num_seqs); a value kvexp derived from one sweep's levels
    describes that sweep, not the GPU asked about. None: not limited."""
    if _user_set(sources, "parallel") and inputs.parallel:
        return int(inputs.parallel)
    if cache.gpu_default_slots is not None and gpu.memory_gib is not None:
        return cache.gpu_default_slots(gpu.memory_gib, gpu.name)
    return cache.default_slots


def _fixed_slots(inputs: PlanInputs, cache: CacheModel) -> int:
    """The slots a fixed-slot server (llama.cpp -np, OLLAMA_NUM_PARALLEL) runs: what the configuration
    launches with (backend.parallel, else the scenario's highest concurrency), else the server's default."""
    return int(inputs.parallel or cache.default_slots or 1)


def _fit(inputs: PlanInputs, sources: Mapping[str, str], cache: CacheModel, gpu: GPUPreset,
         overhead_gib: float) -> tuple[Optional[int], Optional[int], Optional[bool], bool, Optional[int]]:
    """(KV tokens, concurrent requests before preemption/queueing, the configuration fits, the server's
    cap on sequences at once (vLLM --max-num-seqs, llama.cpp/Ollama slots) is what limits the concurrent
    requests, the whole requests the memory alone would hold)."""
    arch = _arch(inputs)
    kv = str(inputs.kv_dtype)
    gpu_gib = float(gpu.memory_gib or 0)
    prompt, out = int(inputs.prompt_tokens or 0), int(inputs.max_tokens or 0)
    request = prompt + out
    if cache.paged:
        slots = _server_slots(inputs, sources, cache, gpu)
        p = planner.plan_job(
            arch, kv, cache, gpu_gib, prompt_tokens=prompt, max_tokens=out, levels=[],
            gpu_memory_utilization=inputs.gpu_memory_utilization, context=inputs.context_tokens, parallel=slots,
            block_size=inputs.block_size if _user_set(sources, "block_size") else None, overhead_gib=overhead_gib,
            tensor_parallel=int(inputs.tensor_parallel or 1), kv_cache_memory_bytes=inputs.kv_cache_memory_bytes
            if _user_set(sources, "kv_cache_memory_bytes") else None)
        pool, served = p["max_concurrency_before_preemption"], p["max_concurrent_requests"]
        capped = slots is not None and pool is not None and served is not None and pool > served
        return p["capacity_tokens"], served, p["fits"], capped, pool
    if arch.weights_gib is None or request <= 0:
        return None, None, None, False, None
    # one slot per request, each with its own stream: what one request's slot takes, window included
    per_request = planner.cells_per_slot(request, 1, cache.cell_pad)
    one = planner.plan_job(arch, kv, cache, None, prompt_tokens=prompt, max_tokens=out, levels=[],
                           context=per_request, parallel=1, overhead_gib=overhead_gib)
    if one["kv_cache_bytes"] is None or one["kv_bytes_per_token"] is None:
        return None, None, None, False, None
    free = (gpu_gib - arch.weights_gib - overhead_gib) * planner.GIB_BYTES
    held = max(0, math.floor(free / one["kv_cache_bytes"]))
    cells = planner.max_context_tokens(gpu_gib, arch.weights_gib, one["kv_bytes_per_token"], overhead_gib=overhead_gib)
    slots = _fixed_slots(inputs, cache)  # the server serves no more requests at once than it has slots
    return (cells if one["sliding_window"] is None else held * per_request), min(held, slots), held > 0, \
        held > slots, held


def what_if(inputs: PlanInputs, sources: Mapping[str, str], cache: CacheModel, gpu: GPUPreset,
            calibration: Optional[Mapping[str, Any]] = None, *, backend: Optional[str] = None) -> dict[str, Any]:
    """One what-if row (JSON-ready; None where unknown): gpu, gpu_name, gpu_gib, backend, model,
    kv_dtype, request_tokens, paged, limit ("preemption" | "queueing"; "max_num_seqs": a paged server's
    cap on sequences at once binds before its pool does; "slots": a slotted server's slots bind before the
    memory does), max_num_seqs (that cap), slots (llama.cpp/Ollama), kv_tokens, max_concurrent (capped by
    either), memory_concurrent (the whole requests the memory alone holds), fits, overhead_gib, and the same three with the calibrated overhead (calibrated_overhead_gib,
    calibrated_from: the GPU(s) it was measured on, calibrated_kv_tokens, calibrated_max_concurrent)."""
    backend = backend or str(inputs.backend or cache.name)
    overhead = planner.DEFAULT_OVERHEAD_GIB if inputs.overhead_gib is None else float(inputs.overhead_gib)
    row: dict[str, Any] = {
        "gpu": gpu.key, "gpu_name": gpu.name, "gpu_gib": gpu.memory_gib, "backend": backend,
        "model": inputs.model, "kv_dtype": inputs.kv_dtype,
        "request_tokens": (inputs.prompt_tokens or 0) + (inputs.max_tokens or 0),
        "paged": cache.paged, "limit": "preemption" if cache.paged else "queueing",
        "max_num_seqs": None, "slots": None, "overhead_gib": overhead, "kv_tokens": None, "max_concurrent": None,
        "memory_concurrent": None, "fits": None,
        "calibrated_overhead_gib": None, "calibrated_from": None, "calibrated_kv_tokens": None,
        "calibrated_max_concurrent": None,
    }
    if gpu.memory_gib is None:
        return row
    row["kv_tokens"], row["max_concurrent"], row["fits"], capped, row["memory_concurrent"] = _fit(
        inputs, sources, cache, gpu, overhead)
    if cache.paged:
        row["max_num_seqs"] = _server_slots(inputs, sources, cache, gpu)
        if capped:
            row["limit"] = "max_num_seqs"
    else:
        row["slots"] = _fixed_slots(inputs, cache)
        if capped:
            row["limit"] = "slots"
    cal, where = overhead_for(calibration, backend, gpu.name, str(inputs.kv_dtype), inputs.dtype_bytes)
    if cal is not None:
        row["calibrated_overhead_gib"], row["calibrated_from"] = round(cal, 4), where
        row["calibrated_kv_tokens"], row["calibrated_max_concurrent"], _, _, _ = _fit(inputs, sources, cache, gpu, cal)
    return row


def from_plan(plan: Plan, cache: CacheModel) -> tuple[PlanInputs, dict[str, str], CacheModel, str]:
    """A what-if configuration from a planner block (a result's planner, prediction.predict): its
    inputs with the block size it used, its sources, the cache model and the backend's name."""
    inputs = replace(plan.inputs or PlanInputs(), block_size=plan.block_size)
    return inputs, dict(plan.sources or {}), cache, str(inputs.backend or cache.name)


def what_if_rows(configs: Iterable[tuple[PlanInputs, Mapping[str, str], CacheModel, str]],
                 gpus: Iterable[GPUPreset], calibration: Optional[Mapping[str, Any]] = None) -> list[dict[str, Any]]:
    """what_if for every (planner inputs, sources, cache model, backend) x GPU, GPU by GPU."""
    configs = list(configs)
    return [what_if(inp, src, cache, g, calibration, backend=b) for g in gpus for inp, src, cache, b in configs]


# ---------------------------------------------------------------------------------------------------
# Formatting (Markdown; the report renders the same rows through its own tables)


def _int(x: Any) -> str:
    return "-" if x is None else f"{x:,}"


def row_cells(r: Mapping[str, Any], scenario: Optional[str] = None) -> list[str]:
    """The what-if table's cells for one row (HEADERS' order)."""
    conc = _int(r["max_concurrent"])
    if r["fits"] is False:
        conc += " (does not fit)"
    cal = "-" if r["calibrated_overhead_gib"] is None else f"{r['calibrated_overhead_gib']:.2f} ({r['calibrated_from']})"
    return [f"{r['gpu_name'] or r['gpu']}", "-" if r["gpu_gib"] is None else f"{r['gpu_gib']:.2f}",
            str(r["model"]), str(r["backend"]), str(r["kv_dtype"]), scenario or "-",
            _int(r["request_tokens"]), _int(r["kv_tokens"]), conc, limit_text(r),
            cal, _int(r["calibrated_kv_tokens"]), _int(r["calibrated_max_concurrent"])]


def limit_text(r: Mapping[str, Any]) -> str:
    """What happens to requests beyond the concurrent ones."""
    if r["limit"] == "max_num_seqs":
        return f"queueing beyond (--max-num-seqs {r['max_num_seqs']:,})"
    if r["limit"] == "slots":  # the memory would hold more requests than the server has slots
        held = "" if r.get("memory_concurrent") is None else f"; the memory holds {r['memory_concurrent']:,}"
        return f"queueing beyond ({r['slots']:,} slots{held})"
    return f"{r['limit']} beyond"


HEADERS = ["GPU", "GiB", "model", "backend", "kv", "scenario", "tokens/request", "KV tokens",
           "concurrent requests", "then", "cal. overhead GiB (measured on)", "cal. KV tokens",
           "cal. concurrent"]


def markdown_table(rows: list[tuple[Mapping[str, Any], Optional[str]]]) -> str:
    """A Markdown what-if table from (row, scenario name) pairs, with its legend."""
    lines = ["| " + " | ".join(HEADERS) + " |",
             "|" + "|".join(["---"] * 6 + ["---:"] * 3 + ["---"] + ["---:"] * 3) + "|"]
    lines += ["| " + " | ".join(row_cells(r, s)) + " |" for r, s in rows]
    legend = ("KV tokens: the KV cache the GPU's memory leaves beside the weights and the overhead (vLLM: the "
              "block pool at its memory utilisation; llama.cpp/Ollama: the largest context that fits). "
              "Concurrent requests: whole requests of the scenario held at once before vLLM preempts (or "
              "queues them beyond its --max-num-seqs: the value set, else vLLM's default for that GPU), or "
              "slots of one request each before llama.cpp/Ollama queue (at most the slots the configuration "
              "launches with: backend.parallel, else the scenario's highest concurrency). cal.: with the overhead this "
              "machine measured (calibration file).")
    return "\n".join(lines + ["", legend]) + "\n"
