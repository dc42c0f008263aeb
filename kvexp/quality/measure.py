"""What a KV dtype costs in quality: the job's KV dtype against the 16-bit KV cache of the same
backend, model file and server build, on the same fixed inputs (definitions in stats.py).

- Teacher-forced drift on a fixed evaluation text at several context depths:
  llama.cpp: `llama-perplexity` with the same -ctk/-ctv (perplexity.py);
  vLLM: `prompt_logprobs` (top k) of the same windows, scored the same way (prompt_logprobs.py);
  Ollama: its API gives no log-probabilities of given text: null, with that reason.
- Greedy-continuation agreement through the serving API on every backend (continuations.py).
- The baseline's outputs are measured once per (backend, model file hash, server build, settings)
  and cached under kvexp's cache dir (cache.py), so a sweep over four KV dtypes measures the baseline
  once; the baseline measured against itself is the determinism check (here).

This module runs one job's measurement and puts its block together; job.py holds the context the
methods share, servers.py the servers they talk to."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import aiohttp

from kvexp.assets import evaltext
from kvexp.core.config import ExperimentConfig
from kvexp.quality import continuations, perplexity, prompt_logprobs, stats as qs
from kvexp.quality.cache import baseline_kv, cache_key, key_parts, quality_cache_dir, write_json
from kvexp.quality.job import QualityJob, teacher_forced_null
from kvexp.results.blocks import Continuation, Quality, TeacherForced
from kvexp.results.documents import JobResult

log = logging.getLogger("kvexp")


def wanted(cfg: ExperimentConfig) -> bool:
    """Whether this job measures quality: a quality scenario, or quality.enabled after speed levels."""
    return cfg.quality.enabled or cfg.scenario.kind == "quality"


def missing(cfg: ExperimentConfig, block: Optional[Quality]) -> bool:
    """A job that wants quality but whose result has no quality block (`block`) yet (e.g. interrupted in it)."""
    return wanted(cfg) and block is None


def measure(cfg: ExperimentConfig, res: JobResult, backend: Any, out_dir: Path) -> Quality:
    """The `quality` block of a job's result: teacher-forced drift per depth, greedy-continuation
    agreement, the baseline's determinism check; null figures where the backend cannot expose them,
    with the reason. The job's server must be running (backend.base_url)."""
    t0 = time.monotonic()
    q = cfg.quality
    text, text_sha, source = evaltext.load(q.text)
    text_path = Path(q.text).expanduser() if q.text else evaltext.SHIPPED
    base_kv = baseline_kv(q.baseline, cfg.kv)
    name = backend.name
    dtype = cfg.kv.per_backend.get(name, "?")
    base_dtype = base_kv.per_backend.get(name)
    block: dict[str, Any] = {
        "kv": cfg.kv.name, "backend_dtype": dtype,
        "baseline": {"kv": base_kv.name, "backend_dtype": base_dtype, "key": None, "cached": None,
                     "measured_by_this_job": [], "cache_dir": None},
        "text": {"source": source, "sha256": text_sha, "chars": len(text)},
        "teacher_forced": None, "continuation": None, "determinism": None, "warnings": [],
        "duration_s": None,
    }
    if base_dtype is None:
        reason = f"the baseline kv={base_kv.name} is not available on backend={name}"
        block["teacher_forced"] = teacher_forced_null(reason)
        block["continuation"] = continuations.continuation_null(q, reason)
        block["warnings"].append(reason)
        block["duration_s"] = round(time.monotonic() - t0, 3)
        return Quality.from_json(block)
    tool = perplexity.perplexity_binary(backend) if backend.teacher_forced == "perplexity_tool" else None
    parts = key_parts(cfg, res, backend, text_sha, base_dtype, tool)
    key = cache_key(parts)
    cache = quality_cache_dir() / f"{name}-{key}"
    if q.cache:
        cache.mkdir(parents=True, exist_ok=True)
        write_json(cache / "key.json", parts)
    else:  # a private folder for this job: nothing is reused or left for later jobs
        cache = out_dir / "quality-baseline"
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True)
    job = QualityJob(cfg, q, backend, dtype, base_kv, base_dtype, dtype == base_dtype, cache, text, text_path,
                     out_dir, res.label or "")
    block["baseline"].update(key=key, cache_dir=str(cache))
    if getattr(cfg.model, backend.served_field(cfg.model), None) == "@tiny":
        job.warnings.append("model=tiny is degenerate by design (nearly one-hot next-token distributions): its "
                            "drift figures mean nothing; use model=tiny-quality")
    if backend.teacher_forced == "perplexity_tool":
        block["teacher_forced"] = perplexity.teacher_forced(job)
    elif backend.teacher_forced == "prompt_logprobs":
        try:
            block["teacher_forced"] = asyncio.run(prompt_logprobs.teacher_forced(job))
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError, KeyError, OSError) as e:
            block["teacher_forced"] = teacher_forced_null(
                f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    else:
        block["teacher_forced"] = teacher_forced_null(f"{name}'s API returns no log-probabilities of given text "
                                                      "(only of generated tokens)")
    block["continuation"] = asyncio.run(continuations.continuation(job))
    tf = TeacherForced.from_json(block["teacher_forced"])
    block["determinism"] = _determinism(tf, Continuation.from_json(block["continuation"]))
    if block["determinism"]["deterministic"] is False:
        job.warnings.append("the 16-bit baseline does not reproduce itself (" + block["determinism"]["summary"]
                            + "): drift figures include this nondeterminism")
    block["baseline"]["measured_by_this_job"] = job.measured
    block["baseline"]["cached"] = not job.measured
    for d in tf.depths:
        if d.status in ("skipped", "failed"):
            job.warnings.append(f"teacher-forced depth {d.context} {d.status}: {d.reason}")
    for w in job.warnings:  # on the terminal too, not only in the result
        log.warning("%s: quality: %s", res.label or cfg.model.name, w)
    block["warnings"] = job.warnings
    block["duration_s"] = round(time.monotonic() - t0, 3)
    return Quality.from_json(block)


def _determinism(tf: TeacherForced, cont: Continuation) -> dict[str, Any]:
    """The baseline against itself: largest self-KLD and lowest self top-1 over the depths, and the
    share of its continuations that came out identical twice."""
    depths = [d for d in tf.depths if d.self_kld_mean is not None]
    kld = max((d.self_kld_mean for d in depths), default=None)  # type: ignore[type-var]
    top1s = [d.self_top1_agreement for d in depths if d.self_top1_agreement is not None]
    top1 = min(top1s) if top1s else None
    ident = cont.self_identical_share
    verdict = qs.deterministic(kld, top1, ident)
    reruns = [d.rerun_identical for d in tf.depths if d.rerun_identical is not None]
    if False in reruns:
        verdict = False
    bits = []
    if reruns:
        bits.append(f"16-bit base file {'byte-identical' if all(reruns) else 'different'} when written twice")
    if kld is not None:
        bits.append(f"mean KLD {kld:.2g}")
    if top1 is not None:
        bits.append(f"top-1 agreement {top1 * 100:.3f} %")
    if ident is not None:
        bits.append(f"{ident * 100:.0f} % identical continuations")
    return {"kld_mean": kld, "top1_agreement": top1, "identical_share": ident, "deterministic": verdict,
            "threshold_kld": qs.DETERMINISM_KLD, "summary": ", ".join(bits) or "nothing measured"}
