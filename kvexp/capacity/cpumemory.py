"""What a server's processes hold in memory on a CPU: the planner's prediction of the figure kvexp measures
there, the peak resident set (RSS) of the server's process tree (measure/gpu.tree_rss_bytes: psutil's
rss of every process of the tree, which is the kernel's VmRSS: anonymous, file-backed and shared pages
alike, so the pages of a memory-mapped model file count once a process has touched them).

    predicted RSS at the end of a level = runtime + weights + buffers + KV cache + prompt cache so far

runtime       the program, its libraries and interpreter, threads, the tokenizer's tables, each slot's state:
              base + per vocabulary entry x vocabulary + per merge x a BPE tokenizer's merges + per slot x
              slots, each coefficient fitted per backend on this machine to measured runs; each backend
              says which (`CpuMemoryModel.runtime_source`).
weights       the model's files on disk (ModelArch.weights_gib) x the backend's weights_factor: llama.cpp
              maps the GGUF and every page a forward pass reads becomes resident; Ollama's log states the
              weights as its runner holds them (its own engine keeps some in another type), which wins;
              vLLM copies the checkpoint into tensors of its own.
buffers       what the server allocates at start beside the mapped weights and the KV cache, as its own log
              states it (llama.cpp: `CPU output buffer size`, a copy of repacked weights `CPU_REPACK model
              buffer size`, and `CPU compute buffer size`, sized for a full micro-batch of n_ubatch tokens).
              The compute buffer becomes resident as far as the largest batch so far reached into it: a
              level of c streams of p-token prompts sends batches of up to min(c, slots) x p tokens, so
              min(1, that / n_ubatch) of it. Not known before the server starts, so a plan made before
              then leaves them out and says so.
KV cache      the planner's kv_cache_bytes: allocated and cleared when the server starts, so resident
              from the first request on.
prompt cache  llama-server only: it keeps finished prompts' states in memory (tools/server/server-task.cpp,
              server_prompt_cache, up to --cache-ram, 8192 MiB by default; its log states each
              "prompt_save" and the cache's size). When a task starts, every idle slot's prompt is saved
              (--cache-idle-slots, the default; without it only the slot the task takes), so at the end
              of a level every request is saved but those still in a slot: the last `concurrency` (the
              last of each slot's). A state is the request's tokens (prompt + output - 1: the last token is
              never decoded) x the KV bytes per token. Distinct prompts are assumed; a workload that
              reuses prompts (shared prefixes, conversations) saves fewer.

Pure: numbers in, numbers out; each adapter declares its `CpuMemoryModel`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

GIB_BYTES = 1 << 30


@dataclass(frozen=True)
class CpuMemoryModel:
    """A server's resident memory on a CPU, as far as the planner models it (declared by its adapter).

    runtime_*: the runtime's coefficients (see the module; `runtime_bytes`); runtime_source: the measurements
    they were fitted to. prompt_cache_limit_bytes: the most the server keeps of finished prompts' states
    (None: it keeps none beside its KV cache)."""

    name: str
    runtime_base_bytes: int
    runtime_source: str
    prompt_cache_limit_bytes: Optional[int] = None
    prompt_cache_source: Optional[str] = None
    runtime_per_vocab_bytes: float = 0.0  # the tokenizer's tables, per vocabulary entry
    runtime_per_merge_bytes: float = 0.0  # a BPE tokenizer's merge table, per merge
    runtime_per_slot_bytes: float = 0.0  # each slot's own state (its sampler's arrays among it)
    weights_factor: float = 1.0  # resident bytes per byte of the model's files (1: the files' pages, or one copy)
    logs_buffers: bool = False  # its log states its buffers (else they are part of the runtime)
    saves_idle_slots: bool = True  # a task that starts saves every idle slot's prompt (else only its own slot's)


@dataclass(frozen=True)
class ServerBuffers:
    """The buffers a server's log states at start: fixed_bytes resident from the start (output buffers,
    repacked weights), compute_bytes sized for ubatch_tokens (None: resident whole), source: the lines;
    weights_bytes: the weights as the server holds them, where its log says and that is not the file's
    size (Ollama's own engine: tensors it keeps in another type than the file's)."""

    fixed_bytes: int
    compute_bytes: int
    ubatch_tokens: Optional[int]
    source: str
    weights_bytes: Optional[int] = None

    def resident(self, batch_tokens: Optional[float]) -> float:
        """What is resident once batches of up to batch_tokens have run (None: unknown, all of it)."""
        if batch_tokens is None or not self.ubatch_tokens:
            return float(self.fixed_bytes + self.compute_bytes)
        return self.fixed_bytes + self.compute_bytes * min(1.0, batch_tokens / self.ubatch_tokens)


def runtime_bytes(model: CpuMemoryModel, vocab: Optional[int], merges: Optional[int], slots: int) -> Optional[int]:
    """The runtime part of the RSS for a model whose tokenizer has `vocab` tokens and `merges` merges, served
    with `slots` slots (None: the vocabulary is unknown and the backend's runtime depends on it)."""
    if vocab is None and model.runtime_per_vocab_bytes:
        return None
    return round(model.runtime_base_bytes + model.runtime_per_vocab_bytes * (vocab or 0)
                 + model.runtime_per_merge_bytes * (merges or 0) + model.runtime_per_slot_bytes * max(1, slots))


def state_bytes(tokens: int, bytes_per_token: float, window_bytes_per_token: Optional[float] = None,
                window: Optional[int] = None) -> float:
    """One saved sequence's KV state: every token in the global layers, at most a window's in the sliding ones."""
    out = tokens * bytes_per_token
    if window_bytes_per_token and window:
        out += min(tokens, window) * window_bytes_per_token
    return out


def saved_prompts(model: CpuMemoryModel, requests_done: int, slots: int, concurrency: int) -> int:
    """Prompt states a llama-server holds at the end of a level, after `requests_done` distinct requests:
    all but those still in a slot (the level's last `concurrency` when idle slots are saved, else the last
    of every slot)."""
    in_slots = min(max(1, concurrency), max(1, slots)) if model.saves_idle_slots else max(1, slots)
    return max(0, requests_done - in_slots)


def predict_rss(model: CpuMemoryModel, *, vocab: Optional[int], merges: Optional[int], weights_bytes: Optional[float],
                kv_cache_bytes: Optional[float],
                slots: int, levels: list[tuple[int, int]], request_state_bytes: Optional[float],
                buffers: Optional[ServerBuffers] = None, prompt_tokens: Optional[float] = None) -> dict[str, Any]:
    """The predicted RSS of a server's process tree at the end of each level (`levels`: the requests the
    server had served by then, warm-up included, and the level's concurrency), and its parts. Keys:
    predicted_peak_rss_gib (the
    last level's, None where the weights or the KV cache are unknown), levels_rss_gib (one per level),
    runtime_bytes, weights_bytes, kv_cache_bytes, prompt_cache_bytes (at the peak; None where the server
    keeps none), saved_prompts, buffers_bytes (at the peak; None: not known, left out), sources. buffers:
    the server's own (its log); prompt_tokens: a request's prompt (the batches its levels send)."""
    cache = []
    saved = [saved_prompts(model, n, slots, c) for n, c in levels]
    for n in saved:
        if model.prompt_cache_limit_bytes is None or request_state_bytes is None:
            cache.append(None if model.prompt_cache_limit_bytes is not None else 0.0)
        else:
            cache.append(min(float(model.prompt_cache_limit_bytes), n * request_state_bytes))
    runtime = runtime_bytes(model, vocab, merges, slots)
    if buffers is not None and buffers.weights_bytes is not None:
        weights_bytes = buffers.weights_bytes
    elif weights_bytes is not None:
        weights_bytes *= model.weights_factor
    known = weights_bytes is not None and kv_cache_bytes is not None and runtime is not None
    resident: list[float] = []  # the buffers resident by the end of each level: the largest batch so far
    batch = 0.0
    for _, c in levels:
        batch = max(batch, min(max(1, c), max(1, slots)) * prompt_tokens) if prompt_tokens else batch
        resident.append(0.0 if buffers is None else buffers.resident(batch if prompt_tokens else None))
    levels_gib = [None if not known or c is None else
                  round((runtime + weights_bytes + b + kv_cache_bytes + c) / GIB_BYTES, 6)  # type: ignore[operator]
                  for c, b in zip(cache, resident)]
    tokenizer = "" if vocab is None else f"; a tokenizer of {vocab:,} tokens" + (
        f" and {merges:,} merges" if merges else "")
    sources = {"runtime_bytes": model.runtime_source + tokenizer,
               "weights_bytes": "the server's log (the weights as it holds them)"
               if buffers is not None and buffers.weights_bytes is not None else
               "the model's files on disk (mapped or loaded, resident once read)",
               "kv_cache_bytes": "the planner's KV cache (allocated and cleared at start)",
               "buffers_bytes": f"{buffers.source}; the compute buffer as far as a level's batches reach "
               "into it (min(concurrency, slots) x prompt tokens of its micro-batch)" if buffers else
               "not known before the server starts (its log states them): left out, the figure is a floor"
               if model.logs_buffers else "part of the runtime"}
    if model.prompt_cache_limit_bytes is not None:
        sources["prompt_cache_bytes"] = model.prompt_cache_source or "the server's prompt cache"
    return {
        "predicted_peak_rss_gib": max((v for v in levels_gib if v is not None), default=None),
        "levels_rss_gib": levels_gib,
        "runtime_bytes": runtime,
        "weights_bytes": None if weights_bytes is None else int(weights_bytes),
        "buffers_bytes": None if buffers is None or not resident else int(resident[-1]),
        "kv_cache_bytes": kv_cache_bytes,
        "prompt_cache_bytes": None if model.prompt_cache_limit_bytes is None or not cache or cache[-1] is None
        else int(cache[-1]),
        "saved_prompts": None if model.prompt_cache_limit_bytes is None or not saved else saved[-1],
        "request_state_bytes": request_state_bytes,
        "sources": sources,
    }
