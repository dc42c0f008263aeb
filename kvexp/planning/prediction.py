"""The planner's prediction for a job: the architecture from the model's files (modelinfo), the
fitted overhead from the calibration table, the maths from planner.py, all over the server the adapter
resolved (so the prediction describes the server that is launched). Where no GPU is known and the server
runs on the CPU, the memory prediction is the server's resident set (cpumemory.py), level by level."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from kvexp.backends import adapter_class
from kvexp.backends.base import ServerSpec
from kvexp.capacity import cpumemory, modelinfo, planner
from kvexp.capacity.planner import ModelArch
from kvexp.core.config import ExperimentConfig
from kvexp.planning.calibration import lookup_overhead_gib
from kvexp.workload import scenario


def scenario_levels(cfg: ExperimentConfig) -> list[int]:
    """Concurrency levels of the scenario (an open-loop scenario: its max_concurrency cap, if any)."""
    s = cfg.scenario
    if s.concurrency:
        return [int(c) for c in s.concurrency]
    return [int(s.max_concurrency)] if s.max_concurrency else []


def model_arch(cfg: ExperimentConfig, spec: ServerSpec) -> ModelArch:
    """The served model's architecture: the file the server was given, else the field it serves from (Ollama
    without a tag imports model.gguf)."""
    return modelinfo.arch_for(cfg.model, adapter_class(spec.backend).served_field(cfg.model), spec.model_path)


def plan_spec(arch: ModelArch, spec: ServerSpec, gpu_gib: Optional[float], *, prompt_tokens: int,
              max_tokens: int, levels: list[int], calibrated_overhead_gib: Optional[float] = None,
              shared_prefix_tokens: int = 0, prefix_groups: int = 1) -> dict[str, Any]:
    """planner.plan_job for the server an adapter resolved: the slots, context, KV dtype, block size
    and KV budget the planner uses are the ones in the launch argv/env, and `sources` says where the
    adapter took each from."""
    out = planner.plan_job(arch, spec.kv_backend_dtype, spec.cache, gpu_gib, prompt_tokens=prompt_tokens,
                           max_tokens=max_tokens, levels=levels, gpu_memory_utilization=spec.gpu_memory_utilization,
                           context=spec.context_tokens, parallel=spec.slots, block_size=spec.block_size,
                           calibrated_overhead_gib=calibrated_overhead_gib, kv_cache_memory_bytes=spec.kv_budget_bytes,
                           unified_kv=spec.unified_kv, shared_prefix_tokens=shared_prefix_tokens,
                           prefix_groups=prefix_groups, tensor_parallel=spec.tensor_parallel)
    out["sources"].update(dict(spec.sources))
    return out


def predict(cfg: ExperimentConfig, spec: ServerSpec, *, gpu_name: Optional[str] = None,
            gpu_gib: Optional[float] = None, calibration: Optional[Mapping[str, Any]] = None,
            arch: Optional[ModelArch] = None, server_log: Optional[str] = None) -> dict[str, Any]:
    """The planner block for a job (result["planner"]). gpu_name / gpu_gib: measured values that
    override cfg.gpu; arch: an architecture already resolved (else read from the model's files);
    server_log: the launched server's log so far (the buffers it states at start; a CPU's RSS)."""
    arch = arch or model_arch(cfg, spec)
    gpu = gpu_gib if gpu_gib is not None else cfg.gpu.memory_gib
    cal = lookup_overhead_gib(calibration, spec.backend, gpu_name or cfg.gpu.name,
                              planner.canonical_kv_dtype(spec.kv_backend_dtype, arch.dtype_bytes))
    s = cfg.scenario

    def plan(lengths: tuple[float, float]) -> dict[str, Any]:
        return plan_spec(arch, spec, gpu, prompt_tokens=round(lengths[0]), max_tokens=round(lengths[1]),
                         levels=scenario_levels(cfg), calibrated_overhead_gib=cal,
                         shared_prefix_tokens=s.prefix_tokens, prefix_groups=s.prefix_groups)

    mean, longest = scenario.mean_lengths(s), scenario.longest_request(s)
    out = plan(mean)
    if tuple(map(round, mean)) != longest:  # lengths vary: the mean plans, the longest bounds the peak
        out["sources"]["prompt_tokens"] = f"mean of the {scenario.kind(s)} workload's lengths (kvexp/workload/)"
        for row, top in zip(out["levels"], plan(longest)["levels"]):
            row["predicted_kv_usage_max"] = top["predicted_kv_usage"]
    if gpu is not None:
        out["sources"]["gpu_gib"] = "measured" if gpu_gib is not None else "gpu config"
    elif spec.cpu_memory is not None:
        cpu_rss(cfg, spec, arch, out, server_log)
    return out


def requests_done(cfg: ExperimentConfig) -> list[int]:
    """Requests a server has served by the end of each planned level, warm-up included (a closed-loop
    scenario's levels in order; open-loop and searched levels: all the scenario's requests, the most)."""
    s = cfg.scenario
    per_level = s.requests * max(1, s.repeats)
    rows = scenario_levels(cfg)
    if s.concurrency and not s.search:
        return [s.warmup_requests + per_level * (i + 1) for i in range(len(rows))]
    levels = len(s.concurrency) or len(s.rates) or 1
    return [s.warmup_requests + per_level * levels] * len(rows)


def cpu_rss(cfg: ExperimentConfig, spec: ServerSpec, arch: ModelArch, out: dict[str, Any],
            server_log: Optional[str] = None) -> None:
    """The server's resident memory on the CPU (cpumemory.py) into a plan: out["cpu_memory"], each level's
    predicted_rss_gib, and predicted_peak_memory_gib the peak RSS (memory_measure "rss"). The buffers a
    server allocates at start are read from its log (None before it starts)."""
    prompt, output = scenario.mean_lengths(cfg.scenario)
    tokens = max(1, round(prompt + output) - 1)  # the last token is sampled, never decoded into the cache
    bpt = out["kv_bytes_per_token"]  # (plan_job's keys, each there, None where unknown)
    state = None if bpt is None else cpumemory.state_bytes(tokens, bpt, out["kv_window_bytes_per_token"],
                                                             out["sliding_window"])
    done = requests_done(cfg)
    weights = None if arch.weights_gib is None else arch.weights_gib * planner.GIB_BYTES
    cpu = cpumemory.predict_rss(spec.cpu_memory, vocab=arch.vocab_size, merges=arch.vocab_merges,  # type: ignore[arg-type]
                                weights_bytes=weights,
                                kv_cache_bytes=out["kv_cache_bytes"], slots=spec.slots or 1,
                                levels=[(n, row["concurrency"]) for n, row in zip(done, out["levels"])],
                                request_state_bytes=state, prompt_tokens=prompt,
                                buffers=adapter_class(spec.backend).logged_buffers(server_log) if server_log else None)
    cpu["requests_done"] = done
    for row, rss in zip(out["levels"], cpu["levels_rss_gib"]):
        row["predicted_rss_gib"] = rss
    out["cpu_memory"] = cpu
    out["predicted_peak_memory_gib"] = cpu["predicted_peak_rss_gib"]
    out["memory_measure"] = "rss"
    out["sources"].update({f"cpu_{k}": v for k, v in cpu["sources"].items()})
    out["sources"]["overhead_gib"] = "not used on the CPU: the memory predicted there is the RSS (cpu_*)"

