"""What a KV dtype costs in quality: the job's KV dtype against the 16-bit KV cache of the same
backend, model file and server build, on the same fixed inputs (definitions in qualitystats.py).

- Teacher-forced drift on a fixed evaluation text at several context depths:
  llama.cpp: `llama-perplexity`, built from the same llama.cpp tree as llama-server, with the same
  -ctk/-ctv: a 16-bit run writes the base file (--kl-divergence-base), the candidate runs read it
  (--kl-divergence). A depth of N means windows of N tokens of which the second half is scored
  (positions N/2 .. N-2 predict the next token), llama-perplexity's own scheme.
  vLLM: `prompt_logprobs` (top k) of the same windows, scored the same way.
  Ollama: its API gives no log-probabilities of given text: null, with that reason.
- Greedy-continuation agreement through the serving API on every backend: N prompts taken from the
  text at offsets drawn from quality.seed, continued at temperature 0 by both.
- The baseline's outputs are measured once per (backend, model file hash, server build, settings)
  and cached under kvexp's cache dir, so a sweep over four KV dtypes measures the baseline once; the
  baseline measured against itself is the determinism check.

This module does the I/O (subprocesses, HTTP, the cache); parsing is pure and tested on recorded
output; the maths is qualitystats.py's."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import random
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import aiohttp

from kvexp.assets import evaltext
from kvexp.quality import stats as qs
from kvexp.backends.base import connector
from kvexp.core.config import ExperimentConfig, KVConfig, QualityConfig
from kvexp.core.paths import atomic_write, sha256_of

log = logging.getLogger("kvexp")

LLAMA_PPL_PRECISION = (
    "llama-perplexity's base file stores each position's log-probabilities as 16-bit integers over "
    "the 16 nats below the most likely token (steps of 16/65535 = 2.4e-4 nats); tokens further down "
    "are left out of the KLD sum and their base log-probability is clamped; it prints the mean KLD "
    "with 6 decimals and percentages with 3, so a mean KLD below 1e-6 reads as 0")
VLLM_PRECISION = (
    "vLLM's prompt_logprobs expose the top {k} log-probabilities per position (plus the actual "
    "token's): the KLD sums over the baseline's top {k} and one bucket for the rest, a lower bound "
    "on the full KLD when the candidate's top {k} holds all of the baseline's (positions where it "
    "did not are counted in inexact_positions)")
PPL_TIMEOUT_S = 3600.0


# --------------------------------------------------------------------------------------------------
# llama-perplexity: the command line and its output (pure)

_NUM = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf|-inf)"
_KLD_LINES = {
    "ppl": rf"Mean PPL\(Q\)\s*:\s*{_NUM}",
    "ppl_base": rf"Mean PPL\(base\)\s*:\s*{_NUM}",
    "delta_ppl": rf"Mean PPL\(Q\)-PPL\(base\)\s*:\s*{_NUM}",
    "kld_mean": rf"Mean\s+KLD:\s*{_NUM}",
    "kld_mean_err": rf"Mean\s+KLD:\s*\S+\s*±\s*{_NUM}",
    "kld_max": rf"Maximum KLD:\s*{_NUM}",
    "kld_p99": rf"99\.0%\s+KLD:\s*{_NUM}",
    "kld_median": rf"Median\s+KLD:\s*{_NUM}",
    "top1_pct": rf"Same top p:\s*{_NUM}",
}
_CHUNKS = re.compile(r"(?:computing|calculating perplexity) over (\d+) chunks, n_ctx=(\d+)")
_FINAL_PPL = re.compile(rf"Final estimate: PPL = {_NUM}")
_TOO_SHORT = re.compile(r"tokenizes to only (\d+) tokens")
_TRAINED = re.compile(r"model was trained on only (\d+) context tokens")


def _num(s: str) -> Optional[float]:
    try:
        v = float(s)
    except ValueError:
        return None
    return v + 0.0 if v == v and abs(v) != float("inf") else None  # + 0.0: "-0.000000" reads 0.0, not -0.0


def parse_kld_output(text: str) -> dict[str, Any]:
    """Figures of a `llama-perplexity --kl-divergence` run (None where a line is missing: fewer than
    100 scored positions print no statistics). top1_agreement is a share (0..1)."""
    out: dict[str, Any] = {}
    for key, pat in _KLD_LINES.items():
        m = re.search(pat, text)
        out[key] = _num(m.group(1)) if m else None
    pct = out.pop("top1_pct")
    out["top1_agreement"] = None if pct is None else pct / 100.0
    out.update(_chunk_facts(text))
    return out


def parse_ppl_output(text: str) -> dict[str, Any]:
    """Figures of a plain `llama-perplexity` run (the one that writes the base file)."""
    m = _FINAL_PPL.search(text)
    return {"ppl": _num(m.group(1)) if m else None, **_chunk_facts(text)}


def _chunk_facts(text: str) -> dict[str, Any]:
    m = _CHUNKS.search(text)
    chunks, n_ctx = (int(m.group(1)), int(m.group(2))) if m else (None, None)
    scored = None if chunks is None else chunks * (n_ctx - 1 - n_ctx // 2)
    short = _TOO_SHORT.search(text)
    trained = _TRAINED.search(text)
    return {"chunks": chunks, "positions": scored,
            "text_tokens": int(short.group(1)) if short else None,
            "model_context": int(trained.group(1)) if trained else None}


def perplexity_argv(binary: str, model: str, text_path: str, depth: int, chunks: int, dtype: str,
                    flash_attn: str, threads: int, n_gpu_layers: Optional[int], base_file: str,
                    kld: bool) -> list[str]:
    argv = [binary, "-m", model, "-f", text_path, "-c", str(depth), "--chunks", str(chunks),
            "-ctk", dtype, "-ctv", dtype, "-fa", flash_attn, "-t", str(threads),
            "--kl-divergence-base", base_file]
    if kld:
        argv.append("--kl-divergence")
    if n_gpu_layers is not None:
        argv += ["-ngl", str(n_gpu_layers)]
    return argv


# --------------------------------------------------------------------------------------------------
# The serving APIs: requests and their answers (pure)

def parse_prompt_logprobs(data: dict[str, Any]) -> list[Optional[dict[int, float]]]:
    """vLLM's choices[0].prompt_logprobs: per prompt position (the first is null) a dict of token id
    -> {logprob, rank, decoded_token} holding the top k and the actual token."""
    plp = (data.get("choices") or [{}])[0].get("prompt_logprobs")
    if plp is None:
        raise ValueError("the answer has no choices[0].prompt_logprobs")
    return [None if d is None else {int(k): float(v["logprob"] if isinstance(v, dict) else v) for k, v in d.items()}
            for d in plp]


def prompt_offsets(n_units: int, length: int, prompts: int, seed: int) -> list[int]:
    """Start offsets of `prompts` prompts of `length` units, drawn from the seed (distinct where the
    text allows)."""
    room = n_units - length
    if room < 1:
        return []
    r = random.Random(seed)
    return r.sample(range(room), prompts) if room >= prompts else [r.randrange(room) for _ in range(prompts)]


# --------------------------------------------------------------------------------------------------
# The baseline cache

def baseline_kv(name: str, like: KVConfig) -> KVConfig:
    """The baseline KV dtype's definition, read from conf/kv/<name>.yaml (the one place its
    per-backend names live), as a copy of `like` (the job's KV config) with that file's fields."""
    import yaml

    from kvexp.core.paths import data_dir

    path = data_dir("conf") / "kv" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"quality.baseline={name}: no such KV option (conf/kv/{name}.yaml)")
    d = yaml.safe_load(path.read_text()) or {}
    known = {f.name for f in dataclasses.fields(like)}
    return dataclasses.replace(like, **{k: v for k, v in d.items() if k in known})


_HASHES: dict[tuple, str] = {}
HASH_MEMO_BYTES = 64 << 20  # files this big have their hash remembered in the cache dir too


def file_sha256(path: Path) -> str:
    """sha256 of a file, remembered per path, size and mtime: for this process, and for large files
    (a model of many GB takes a while to hash) in the quality cache's hashes.json."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _HASHES:
        return _HASHES[key]
    memo_path = quality_cache_dir() / "hashes.json"
    memo_key = "|".join(map(str, key))
    memo = (_read_json(memo_path) or {}) if st.st_size >= HASH_MEMO_BYTES else {}
    digest = memo.get(memo_key)
    if digest is None:
        digest = sha256_of(path)
        if st.st_size >= HASH_MEMO_BYTES:
            try:
                _write_json(memo_path, {**memo, memo_key: digest})
            except OSError:
                pass  # a read-only cache: the hash is computed again next time
    _HASHES[key] = digest
    return digest


def model_sha256(path: Optional[str]) -> Optional[str]:
    """A GGUF file's sha256, or for a model folder the sha256 of its files' names and hashes."""
    if not path:
        return None
    p = Path(path).expanduser()
    if p.is_file():
        return file_sha256(p)
    if p.is_dir():
        h = hashlib.sha256()
        for f in sorted(x for x in p.rglob("*") if x.is_file()):
            h.update(f"{f.relative_to(p)}:{file_sha256(f)}\n".encode())
        return h.hexdigest()
    return None


def cache_key(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def quality_cache_dir() -> Path:
    """Where baselines are kept: $KVEXP_QUALITY_CACHE, else kvexp's cache dir / quality."""
    from kvexp.core.paths import cache_dir

    return Path(os.environ.get("KVEXP_QUALITY_CACHE") or cache_dir() / "quality")


def _read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(doc, allow_nan=False))


# --------------------------------------------------------------------------------------------------
# One job's quality measurement

@dataclass
class _Ctx:
    cfg: ExperimentConfig
    q: QualityConfig
    backend: Any  # the job's adapter, base_url set to its running server
    dtype: str  # the job's KV dtype, backend spelling
    base_kv: KVConfig
    base_dtype: str
    is_baseline: bool
    cache: Path
    text: str
    text_path: Path
    out_dir: Path
    label: str
    measured: list[str] = dataclasses.field(default_factory=list)  # what this job measured of the baseline
    warnings: list[str] = dataclasses.field(default_factory=list)


def wanted(cfg: ExperimentConfig) -> bool:
    """Whether this job measures quality: a quality scenario, or quality.enabled after speed levels."""
    return cfg.quality.enabled or cfg.scenario.kind == "quality"


def missing(cfg: ExperimentConfig, result: dict[str, Any]) -> bool:
    """A job that wants quality but whose result has no quality block yet (e.g. interrupted in it)."""
    return wanted(cfg) and not isinstance(result.get("quality"), dict)


def measure(cfg: ExperimentConfig, res: dict[str, Any], backend: Any, out_dir: Path) -> dict[str, Any]:
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
        block["teacher_forced"] = _tf_null(reason)
        block["continuation"] = _cont_null(q, reason)
        block["warnings"].append(reason)
        block["duration_s"] = round(time.monotonic() - t0, 3)
        return block
    parts = _key_parts(cfg, res, backend, text_sha, base_dtype)
    key = cache_key(parts)
    cache = quality_cache_dir() / f"{name}-{key}"
    if q.cache:
        cache.mkdir(parents=True, exist_ok=True)
        _write_json(cache / "key.json", parts)
    else:  # a private folder for this job: nothing is reused or left for later jobs
        cache = out_dir / "quality-baseline"
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True)
    ctx = _Ctx(cfg, q, backend, dtype, base_kv, base_dtype, dtype == base_dtype, cache, text, text_path,
               out_dir, res.get("label") or "")
    block["baseline"].update(key=key, cache_dir=str(cache))
    if getattr(cfg.model, backend.model_field, None) == "@tiny":
        ctx.warnings.append("model=tiny is degenerate by design (nearly one-hot next-token distributions): its "
                            "drift figures mean nothing; use model=tiny-quality")
    if backend.teacher_forced == "perplexity_tool":
        block["teacher_forced"] = _tf_llamacpp(ctx)
    elif backend.teacher_forced == "prompt_logprobs":
        try:
            block["teacher_forced"] = asyncio.run(_tf_vllm(ctx))
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError, KeyError, OSError) as e:
            block["teacher_forced"] = _tf_null(f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    else:
        block["teacher_forced"] = _tf_null(f"{name}'s API returns no log-probabilities of given text "
                                           "(only of generated tokens)")
    block["continuation"] = asyncio.run(_continuation(ctx))
    block["determinism"] = _determinism(block)
    if block["determinism"]["deterministic"] is False:
        ctx.warnings.append("the 16-bit baseline does not reproduce itself (" + block["determinism"]["summary"]
                            + "): drift figures include this nondeterminism")
    block["baseline"]["measured_by_this_job"] = ctx.measured
    block["baseline"]["cached"] = not ctx.measured
    block["warnings"] = ctx.warnings
    block["duration_s"] = round(time.monotonic() - t0, 3)
    return block


def _key_parts(cfg: ExperimentConfig, res: dict[str, Any], backend: Any, text_sha: str,
               base_dtype: str) -> dict[str, Any]:
    """What the baseline's outputs depend on: backend, model file, server build, the numerics settings
    that apply to the baseline's KV dtype, the text and the measurement settings."""
    q = cfg.quality
    parts: dict[str, Any] = {
        "backend": backend.name, "model_sha256": model_sha256(backend.model_path),
        "model": backend.model_path,
        "server_build": (res.get("backend") or {}).get("version"), "text_sha256": text_sha,
        "settings": {k: getattr(q, k) for k in ("chunks", "prompts", "prompt_tokens", "max_tokens", "top_k",
                                                 "seed", "baseline")},
    }
    if backend.teacher_forced == "perplexity_tool":
        ppl = _perplexity_binary(backend)
        parts["perplexity_sha256"] = file_sha256(ppl) if ppl else None
    numerics = backend.numerics(base_dtype)
    if numerics:
        parts["numerics"] = numerics
    return parts


def _perplexity_binary(backend: Any) -> Optional[Path]:
    from kvexp.assets.install import find_llama_perplexity

    return find_llama_perplexity(backend.program)


def _tf_null(reason: str) -> dict[str, Any]:
    return {"method": None, "precision": None, "top_k": None, "depths": [], "reason": reason}


def _cont_null(q: QualityConfig, reason: str) -> dict[str, Any]:
    return {"prompts": q.prompts, "prompt_tokens": q.prompt_tokens, "max_tokens": q.max_tokens, "unit": None,
            "identical_share": None, "first_diff_mean": None, "prefix_agreement": None,
            "kld_prefix_mean": None, "top_k": None, "reason": reason}


def _depth_entry(depth: int, **kw: Any) -> dict[str, Any]:
    entry = {"context": depth, "status": "ok", "reason": None, "chunks": None, "positions": None,
             "kld_mean": None, "kld_mean_err": None, "kld_median": None, "kld_p99": None, "kld_max": None,
             "top1_agreement": None, "ppl_base": None, "ppl": None, "delta_ppl": None,
             "inexact_positions": None, "self_kld_mean": None, "self_top1_agreement": None,
             "rerun_identical": None, "ppl_base_f32": None}
    entry.update(kw)
    return entry


# --- teacher-forced: llama.cpp ---------------------------------------------------------------------

PPL_ATTEMPTS = 8


def _run_ppl(argv: list[str], log_path: Path, wanted: Optional[str] = None,
             env: Optional[dict[str, str]] = None) -> str:
    """Run llama-perplexity, append its output to log_path, return it; raises RuntimeError with
    the output's last line when it fails. llama.cpp's logger writes from a thread of its own and
    is not flushed at exit (its own comment in common/log.cpp), so the last lines of a run that
    succeeded can be lost: a run whose output lacks `wanted` is repeated, up to PPL_ATTEMPTS times.
    env: the server's environment (its numerics settings, e.g. LLAMA_ATTN_ROT_DISABLE, apply here too)."""
    out = ""
    for attempt in range(1, PPL_ATTEMPTS + 1):
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, errors="replace", timeout=PPL_TIMEOUT_S, env=env)
        out = r.stdout
        with open(log_path, "a", encoding="utf-8") as f:
            f.write("$ " + " ".join(argv) + "\n" + out + f"\n[exit status {r.returncode}, attempt {attempt}]\n\n")
        if r.returncode != 0:
            last = (out.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"llama-perplexity exited with status {r.returncode}: {last}")
        if wanted is None or wanted in out or _TOO_SHORT.search(out):
            return out
    return out


def _tf_llamacpp(ctx: _Ctx) -> dict[str, Any]:
    binary = _perplexity_binary(ctx.backend)
    if binary is None:
        return _tf_null("llama-perplexity not found beside llama-server, on PATH or in kvexp's cache: "
                        "run `python -m kvexp install llamacpp`")
    model = ctx.backend.model_path
    if not model:
        return _tf_null("the job attached to an endpoint: no local GGUF for llama-perplexity to read")
    depths = []
    for depth in ctx.q.depths:
        try:
            depths.append(_tf_llamacpp_depth(ctx, str(binary), model, depth))
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
            depths.append(_depth_entry(depth, status="failed", reason=str(e).splitlines()[0][:300]))
    return {"method": "llama-perplexity --kl-divergence (all logits)", "precision": LLAMA_PPL_PRECISION,
            "top_k": None, "depths": depths, "reason": None}


def _tf_llamacpp_depth(ctx: _Ctx, binary: str, model: str, depth: int) -> dict[str, Any]:
    """One depth: the baseline's base file (made once: the 16-bit run written twice, and the two
    files compared byte for byte, which is the determinism check), then the job's own run against
    it. For the baseline job itself that run is the 16-bit KV against its own 16-bit base file:
    the floor of the method (what the 16-bit storage of the base file alone costs)."""
    base_file = ctx.cache / f"tf-ctx{depth}.kld"
    base_json = ctx.cache / f"tf-ctx{depth}.json"
    log_path = ctx.out_dir / "quality.log"
    env = ctx.backend.spec.process_env()

    def argv(dtype: str, file: Path, kld: bool) -> list[str]:
        n = ctx.backend.numerics()
        return perplexity_argv(binary, model, str(ctx.text_path), depth, ctx.q.chunks, dtype, n["flash_attn"],
                               n["threads"], n["n_gpu_layers"], str(file), kld)

    def write_base(file: Path) -> dict[str, Any]:
        return parse_ppl_output(_run_ppl(argv(ctx.base_dtype, file, False), log_path, "Final estimate", env))

    def kld_run(dtype: str) -> dict[str, Any]:
        return parse_kld_output(_run_ppl(argv(dtype, base_file, True), log_path, "Same top p:", env))

    tmp = base_file.with_suffix(f".tmp{os.getpid()}")
    again = base_file.with_suffix(f".again{os.getpid()}")
    try:
        base = _read_json(base_json) if base_file.is_file() else None
        if base is None:
            first = write_base(tmp)
            if not tmp.is_file() or first["chunks"] is None:
                why = (f"the text has {first['text_tokens']} tokens; depth {depth} needs {2 * depth}"
                       if first["text_tokens"] is not None else "llama-perplexity wrote no base file")
                return _depth_entry(depth, status="skipped", reason=why)
            write_base(again)
            identical = file_sha256(tmp) == file_sha256(again)
            os.replace(tmp, base_file)
            base = {"ppl": first["ppl"], "chunks": first["chunks"], "positions": first["positions"],
                    "rerun_identical": identical, "measured_by": ctx.label}
            _write_json(base_json, base)
            ctx.measured.append(f"teacher-forced depth {depth}")
            rerun_identical = identical
        elif ctx.is_baseline:  # the baseline job checks the cached base file against a fresh one
            write_base(again)
            rerun_identical = file_sha256(again) == file_sha256(base_file)
        else:
            rerun_identical = base.get("rerun_identical")
    finally:
        tmp.unlink(missing_ok=True)
        again.unlink(missing_ok=True)
    figures = kld_run(ctx.base_dtype if ctx.is_baseline else ctx.dtype)
    entry = _depth_entry(depth, chunks=figures["chunks"], positions=figures["positions"],
                         **{k: figures[k] for k in ("kld_mean", "kld_mean_err", "kld_median", "kld_p99", "kld_max",
                                                    "top1_agreement", "ppl_base", "ppl", "delta_ppl")},
                         self_kld_mean=0.0 if rerun_identical else None,
                         self_top1_agreement=1.0 if rerun_identical else None,
                         rerun_identical=rerun_identical, ppl_base_f32=base["ppl"])
    if figures["kld_mean"] is None:
        entry.update(status="failed", reason="llama-perplexity printed no KL divergence statistics "
                                             f"in {PPL_ATTEMPTS} runs (it prints them from 100 scored positions on)")
    mc = figures.get("model_context")
    if mc is not None and depth > mc:
        entry["reason"] = f"beyond the model's trained context ({mc} tokens)"
    return entry


# --- teacher-forced: vLLM ---------------------------------------------------------------------------

def _session(base_url: str) -> aiohttp.ClientSession:
    """A session for one server's quality requests (URLs are absolute; base_url names the server)."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800), connector=connector())


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url, json=body) as r:
        text = await r.text()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status} from {url}: {text[:300]}")
        return json.loads(text)


async def _vllm_windows_logprobs(backend: Any, session: aiohttp.ClientSession, tokens: list[int], depth: int,
                                 chunks: int, k: int) -> list[list[dict[int, float]]]:
    """Per window of `depth` tokens, the scored positions' exposed log-probabilities."""
    out = []
    for j in range(chunks):
        ids = tokens[j * depth:(j + 1) * depth]
        data = await _post(session, backend.base_url + "/v1/completions",
                           {"model": backend.served_name, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                            "prompt_logprobs": k})
        plp = parse_prompt_logprobs(data)
        out.append([plp[i] or {} for i in _scored(depth)])
    return out


def _scored(depth: int) -> range:
    """Target positions scored in a window (llama-perplexity's: the second half, N/2+1 .. N-1)."""
    return range(depth // 2 + 1, depth)


def _vllm_drift(base: list[list[dict[int, float]]], cand: list[list[dict[int, float]]], tokens: list[int],
                depth: int) -> qs.DriftSummary:
    b, c, t = [], [], []
    for j, (bw, cw) in enumerate(zip(base, cand)):
        for i, bp, cp in zip(_scored(depth), bw, cw):
            b.append(qs.TopK(bp))
            c.append(qs.TopK(cp))
            t.append(tokens[j * depth + i])
    return qs.drift(b, c, t)


async def _tf_vllm(ctx: _Ctx) -> dict[str, Any]:
    k = ctx.q.top_k
    max_len = ctx.backend.spec.context_per_seq_tokens
    async with _session(ctx.backend.base_url) as session:
        tokens = await ctx.backend.tokenize(session, ctx.text)
        depths, todo = [], []
        for depth in ctx.q.depths:
            n = min(ctx.q.chunks, len(tokens) // depth)
            if max_len is not None and depth + 1 > max_len:
                depths.append(_depth_entry(depth, status="skipped", reason=(
                    f"beyond the server's context ({max_len} tokens, --max-model-len): set backend.context")))
            elif n < 1:
                depths.append(_depth_entry(depth, status="skipped", reason=(
                    f"the text has {len(tokens)} tokens, fewer than one window of {depth}")))
            else:
                todo.append((depth, n))
                depths.append(None)
        base: dict[int, Any] = {}
        missing = []
        for depth, n in todo:
            cached = _read_json(ctx.cache / f"tf-ctx{depth}.json")
            if cached is not None and cached.get("chunks") == n:
                base[depth] = cached
            else:
                missing.append((depth, n))
        if missing:
            async with _baseline_backend(ctx) as bb:
                async with _session(bb.base_url) as bs:
                    for depth, n in missing:
                        first = await _vllm_windows_logprobs(bb, bs, tokens, depth, n, k)
                        again = await _vllm_windows_logprobs(bb, bs, tokens, depth, n, k)
                        self_check = _vllm_drift(_int_keys(first), _int_keys(again), tokens, depth)
                        doc = {"chunks": n, "windows": [[{str(t): v for t, v in p.items()} for p in w] for w in first],
                               "self": _drift_fields(self_check), "measured_by": ctx.label}
                        _write_json(ctx.cache / f"tf-ctx{depth}.json", doc)
                        base[depth] = doc
                        ctx.measured.append(f"teacher-forced depth {depth}")
        for depth, n in todo:
            doc = base[depth]
            bw = _int_keys(doc["windows"])
            cand = await _vllm_windows_logprobs(ctx.backend, session, tokens, depth, n, k)
            d = _vllm_drift(bw, cand, tokens, depth)
            entry = _depth_entry(depth, chunks=n, **_drift_fields(d),
                                 self_kld_mean=doc["self"]["kld_mean"],
                                 self_top1_agreement=doc["self"]["top1_agreement"])
            depths[depths.index(None)] = entry
    return {"method": f"vLLM prompt_logprobs (top {k})", "precision": VLLM_PRECISION.format(k=k), "top_k": k,
            "depths": depths, "reason": None}


def _int_keys(windows: list[list[dict]]) -> list[list[dict[int, float]]]:
    return [[{int(t): float(v) for t, v in p.items()} for p in w] for w in windows]


def _drift_fields(d: qs.DriftSummary) -> dict[str, Any]:
    return {"positions": d.positions, "kld_mean": d.kld_mean, "kld_median": d.kld_median, "kld_p99": d.kld_p99,
            "kld_max": d.kld_max, "top1_agreement": d.top1_agreement, "ppl_base": d.ppl_base, "ppl": d.ppl,
            "delta_ppl": d.delta_ppl, "inexact_positions": d.inexact_positions}


# --- the baseline's own server ----------------------------------------------------------------------

@contextlib.asynccontextmanager
async def _baseline_backend(ctx: _Ctx):
    """A backend whose server runs the baseline KV dtype: the job's own server when the job is the
    baseline, else a server kvexp launches for it now (same backend settings and model), stopped
    afterwards; its log is the job folder's baseline-server.log."""
    if ctx.is_baseline:
        yield ctx.backend
        return
    if ctx.cfg.backend.endpoint:
        raise RuntimeError(f"the baseline (kv={ctx.base_kv.name}) is not cached and the job is attached to "
                           f"an endpoint: run a kv={ctx.base_kv.name} job on it first")
    with _launched_baseline(ctx) as backend:
        yield backend


@contextlib.contextmanager
def _launched_baseline(ctx: _Ctx) -> Iterator[Any]:
    from kvexp import backends
    from kvexp.backends.pool import ServerPool

    cfg = dataclasses.replace(ctx.cfg, kv=ctx.base_kv)
    backend = backends.create(cfg)
    pool = ServerPool()
    log.info("%s: measuring the kv=%s baseline on a server of its own", ctx.label, ctx.base_kv.name)
    server, _ = pool.acquire(backend, cfg, ctx.out_dir / "baseline-server.log")
    backend.base_url = server.base_url
    try:
        yield backend
    finally:
        pool.release()


# --- greedy continuations ---------------------------------------------------------------------------

async def _prompts(ctx: _Ctx, backend: Any, session: aiohttp.ClientSession) -> list[Any]:
    q = ctx.q
    if not backend.capabilities.exact_prompts:  # no tokenizer endpoint: text of about 4 characters a token
        n = q.prompt_tokens * 4
        return [ctx.text[o:o + n] for o in prompt_offsets(len(ctx.text), n, q.prompts, q.seed)]
    tokens = await backend.tokenize(session, ctx.text)
    return [tokens[o:o + q.prompt_tokens] for o in prompt_offsets(len(tokens), q.prompt_tokens, q.prompts, q.seed)]


async def _continue_all(ctx: _Ctx, backend: Any, session: aiohttp.ClientSession,
                        prompts: list[Any]) -> list[dict[str, Any]]:
    out = []
    for i, p in enumerate(prompts):
        req = backend.continuation_request(p, ctx.q.max_tokens, ctx.q.top_k, ctx.q.seed * 1000 + i)
        units, tops = backend.parse_continuation(await _post(session, backend.base_url + req.path, req.body))
        out.append({"units": units, "top": [None if t is None else {str(k): v for k, v in t.items()} for t in tops]})
    return out


def _tops(c: dict[str, Any]) -> list[Optional[qs.TopK]]:
    return [None if t is None else qs.TopK({int(k): float(v) for k, v in t.items()}) for t in c["top"]]


def _compare_continuations(base: list[dict[str, Any]], cand: list[dict[str, Any]]) -> tuple[qs.ContinuationAgreement,
                                                                                             Optional[float]]:
    """Agreement, and the mean top-k KLD over the positions before each first difference (the same
    context on both sides); None where top-k is not exposed."""
    agree = qs.continuation_agreement([b["units"] for b in base], [c["units"] for c in cand])
    klds = []
    for b, c in zip(base, cand):
        d = qs.first_difference(b["units"], c["units"])
        end = len(b["units"]) if d is None else d
        for tb, tc in list(zip(_tops(b), _tops(c)))[:end]:
            if tb is not None and tc is not None and tb.logprobs and tc.logprobs:
                klds.append(qs.topk_kld(tb, tc)[0])
    return agree, (sum(klds) / len(klds) if klds else None)


async def _continuation(ctx: _Ctx) -> dict[str, Any]:
    q = ctx.q
    unit = ctx.backend.continuation_unit
    path = ctx.cache / "continuations.json"
    try:
        async with _session(ctx.backend.base_url) as session:
            prompts = await _prompts(ctx, ctx.backend, session)
            if not prompts:
                return _cont_null(q, f"the text is shorter than one prompt of {q.prompt_tokens} {unit}s")
            base = _read_json(path)
            if base is None or len(base.get("first") or []) != len(prompts):
                async with _baseline_backend(ctx) as bb:
                    async with _session(bb.base_url) as bs:
                        first = await _continue_all(ctx, bb, bs, prompts)
                        again = await _continue_all(ctx, bb, bs, prompts)
                self_agree, self_kld = _compare_continuations(first, again)
                base = {"first": first, "self": {**dataclasses.asdict(self_agree), "kld_prefix_mean": self_kld},
                        "measured_by": ctx.label}
                _write_json(path, base)
                ctx.measured.append("continuations")
                if ctx.is_baseline:
                    cand = again
                else:
                    cand = await _continue_all(ctx, ctx.backend, session, prompts)
            else:
                cand = await _continue_all(ctx, ctx.backend, session, prompts)
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError, KeyError) as e:
        return _cont_null(q, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    agree, kld = _compare_continuations(base["first"], cand)
    self_identical = agree.identical_share if ctx.is_baseline else base["self"]["identical_share"]
    has_top = any(t is not None for c in cand for t in c["top"])
    return {"prompts": agree.prompts, "prompt_tokens": q.prompt_tokens, "max_tokens": q.max_tokens, "unit": unit,
            "identical_share": agree.identical_share, "first_diff_mean": agree.first_diff_mean,
            "prefix_agreement": agree.prefix_agreement, "kld_prefix_mean": kld,
            "top_k": q.top_k if has_top else None,
            "self_identical_share": self_identical,
            "reason": None if has_top else f"{ctx.backend.name} exposes no log-probabilities of generated "
                                           "tokens here: agreement only"}


def _determinism(block: dict[str, Any]) -> dict[str, Any]:
    """The baseline against itself: largest self-KLD and lowest self top-1 over the depths, and the
    share of its continuations that came out identical twice."""
    depths = [d for d in (block["teacher_forced"] or {}).get("depths") or [] if d.get("self_kld_mean") is not None]
    kld = max((d["self_kld_mean"] for d in depths), default=None)
    top1s = [d["self_top1_agreement"] for d in depths if d.get("self_top1_agreement") is not None]
    top1 = min(top1s) if top1s else None
    ident = (block["continuation"] or {}).get("self_identical_share")
    verdict = qs.deterministic(kld, top1, ident)
    reruns = [d.get("rerun_identical") for d in (block["teacher_forced"] or {}).get("depths") or []
              if d.get("rerun_identical") is not None]
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
