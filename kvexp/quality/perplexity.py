"""Teacher-forced drift on llama.cpp: `llama-perplexity`, built from the same llama.cpp tree as
llama-server, with the same -ctk/-ctv. A 16-bit run writes the base file (--kl-divergence-base), the
candidate runs read it (--kl-divergence). A depth of N means windows of N tokens of which the second
half is scored (positions N/2 .. N-2 predict the next token), llama-perplexity's own scheme.

The command line and the output's parsing are pure (tested on recorded output); running it and the
base files in the baseline cache are the rest."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any, Optional

from kvexp.assets.install import find_llama_perplexity
from kvexp.capacity.planner import kv_pair
from kvexp.quality.cache import file_sha256, read_json, write_json
from kvexp.quality.job import QualityJob, depth_entry, teacher_forced_null

LLAMA_PPL_PRECISION = (
    "llama-perplexity's base file stores each position's log-probabilities as 16-bit integers over "
    "the 16 nats below the most likely token (steps of 16/65535 = 2.4e-4 nats); tokens further down "
    "are left out of the KLD sum and their base log-probability is clamped; it prints the mean KLD "
    "with 6 decimals and percentages with 3, so a mean KLD below 1e-6 reads as 0")
PPL_TIMEOUT_S = 3600.0
PPL_ATTEMPTS = 8


# --------------------------------------------------------------------------------------------------
# The command line and its output (pure)

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
            "-ctk", kv_pair(dtype)[0], "-ctv", kv_pair(dtype)[1], "-fa", flash_attn, "-t", str(threads),
            "--kl-divergence-base", base_file]
    if kld:
        argv.append("--kl-divergence")
    if n_gpu_layers is not None:
        argv += ["-ngl", str(n_gpu_layers)]
    return argv


# --------------------------------------------------------------------------------------------------
# Running it

def perplexity_binary(backend: Any) -> Optional[Path]:
    """The llama-perplexity built with the backend's llama-server (None: not found)."""
    return find_llama_perplexity(backend.program)


def run_perplexity(argv: list[str], log_path: Path, wanted: Optional[str] = None,
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


def teacher_forced(job: QualityJob) -> dict[str, Any]:
    """The `teacher_forced` block of a llama.cpp job: one entry per depth."""
    binary = perplexity_binary(job.backend)
    if binary is None:
        return teacher_forced_null("llama-perplexity not found beside llama-server, on PATH or in kvexp's cache: "
                                   "run `python -m kvexp install llamacpp`")
    model = job.backend.model_path
    if not model:
        return teacher_forced_null("the job attached to an endpoint: no local GGUF for llama-perplexity to read")
    depths = []
    for depth in job.q.depths:
        try:
            depths.append(_depth(job, str(binary), model, depth))
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
            depths.append(depth_entry(depth, status="failed", reason=str(e).splitlines()[0][:300]))
    return {"method": "llama-perplexity --kl-divergence (all logits)", "precision": LLAMA_PPL_PRECISION,
            "top_k": None, "depths": depths, "reason": None}


def _depth(job: QualityJob, binary: str, model: str, depth: int) -> dict[str, Any]:
    """One depth: the baseline's base file (made once: the 16-bit run written twice, and the two
    files compared byte for byte, which is the determinism check), then the job's own run against
    it. For the baseline job itself that run is the 16-bit KV against its own 16-bit base file:
    the floor of the method (what the 16-bit storage of the base file alone costs)."""
    base_file = job.cache / f"tf-ctx{depth}.kld"
    base_json = job.cache / f"tf-ctx{depth}.json"
    log_path = job.out_dir / "quality.log"
    env = job.backend.spec.process_env()

    def argv(dtype: str, file: Path, kld: bool) -> list[str]:
        n = job.backend.numerics()
        return perplexity_argv(binary, model, str(job.text_path), depth, job.q.chunks, dtype, n["flash_attn"],
                               n["threads"], n["n_gpu_layers"], str(file), kld)

    def write_base(file: Path) -> dict[str, Any]:
        return parse_ppl_output(run_perplexity(argv(job.base_dtype, file, False), log_path, "Final estimate", env))

    def kld_run(dtype: str) -> dict[str, Any]:
        return parse_kld_output(run_perplexity(argv(dtype, base_file, True), log_path, "Same top p:", env))

    tmp = base_file.with_suffix(f".tmp{os.getpid()}")
    again = base_file.with_suffix(f".again{os.getpid()}")
    try:
        base = read_json(base_json) if base_file.is_file() else None
        if base is None:
            first = write_base(tmp)
            if not tmp.is_file() or first["chunks"] is None:
                why = (f"the text has {first['text_tokens']} tokens; depth {depth} needs {2 * depth}"
                       if first["text_tokens"] is not None else "llama-perplexity wrote no base file")
                return depth_entry(depth, status="skipped", reason=why)
            write_base(again)
            identical = file_sha256(tmp) == file_sha256(again)
            os.replace(tmp, base_file)
            base = {"ppl": first["ppl"], "chunks": first["chunks"], "positions": first["positions"],
                    "rerun_identical": identical, "measured_by": job.label}
            write_json(base_json, base)
            job.measured.append(f"teacher-forced depth {depth}")
            rerun_identical = identical
        elif job.is_baseline:  # the baseline job checks the cached base file against a fresh one
            write_base(again)
            rerun_identical = file_sha256(again) == file_sha256(base_file)
        else:
            rerun_identical = base.get("rerun_identical")
    finally:
        tmp.unlink(missing_ok=True)
        again.unlink(missing_ok=True)
    figures = kld_run(job.base_dtype if job.is_baseline else job.dtype)
    entry = depth_entry(depth, chunks=figures["chunks"], positions=figures["positions"],
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
