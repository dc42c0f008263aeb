"""Teacher-forced drift on vLLM: `prompt_logprobs` (top k) of the same windows llama-perplexity
scores (windows of N tokens, the second half scored), the baseline's kept in the baseline cache.
Parsing the answer is pure (tested on recorded answers); the maths is stats.py's."""

from __future__ import annotations

from typing import Any, Optional

import aiohttp

from kvexp.quality import servers, stats as qs
from kvexp.quality.cache import read_json, write_json
from kvexp.quality.job import QualityJob, depth_entry

VLLM_PRECISION = (
    "vLLM's prompt_logprobs expose the top {k} log-probabilities per position (plus the actual "
    "token's): the KLD sums over the baseline's top {k} and one bucket for the rest, a lower bound "
    "on the full KLD when the candidate's top {k} holds all of the baseline's (positions where it "
    "did not are counted in inexact_positions)")


def parse_prompt_logprobs(data: dict[str, Any]) -> list[Optional[dict[int, float]]]:
    """vLLM's choices[0].prompt_logprobs: per prompt position (the first is null) a dict of token id
    -> {logprob, rank, decoded_token} holding the top k and the actual token."""
    plp = (data.get("choices") or [{}])[0].get("prompt_logprobs")
    if plp is None:
        raise ValueError("the answer has no choices[0].prompt_logprobs")
    return [None if d is None else {int(k): float(v["logprob"] if isinstance(v, dict) else v) for k, v in d.items()}
            for d in plp]


def _scored(depth: int) -> range:
    """Target positions scored in a window (llama-perplexity's: the second half, N/2+1 .. N-1)."""
    return range(depth // 2 + 1, depth)


async def _windows_logprobs(backend: Any, session: aiohttp.ClientSession, tokens: list[int], depth: int,
                            chunks: int, k: int) -> list[list[dict[int, float]]]:
    """Per window of `depth` tokens, the scored positions' exposed log-probabilities."""
    out = []
    for j in range(chunks):
        ids = tokens[j * depth:(j + 1) * depth]
        data = await servers.post(session, backend.base_url + "/v1/completions",
                                  {"model": backend.served_name, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                                   "prompt_logprobs": k})
        plp = parse_prompt_logprobs(data)
        out.append([plp[i] or {} for i in _scored(depth)])
    return out


def _drift(base: list[list[dict[int, float]]], cand: list[list[dict[int, float]]], tokens: list[int],
           depth: int) -> qs.DriftSummary:
    b, c, t = [], [], []
    for j, (bw, cw) in enumerate(zip(base, cand)):
        for i, bp, cp in zip(_scored(depth), bw, cw):
            b.append(qs.TopK(bp))
            c.append(qs.TopK(cp))
            t.append(tokens[j * depth + i])
    return qs.drift(b, c, t)


async def teacher_forced(job: QualityJob) -> dict[str, Any]:
    """The `teacher_forced` block of a vLLM job: one entry per depth."""
    k = job.q.top_k
    max_len = job.backend.spec.context_per_seq_tokens
    async with servers.session(job.backend.base_url) as session:
        tokens = await job.backend.tokenize(session, job.text)
        depths, todo = [], []
        for depth in job.q.depths:
            n = min(job.q.chunks, len(tokens) // depth)
            if max_len is not None and depth + 1 > max_len:
                depths.append(depth_entry(depth, status="skipped", reason=(
                    f"beyond the server's context ({max_len} tokens, --max-model-len): set backend.context")))
            elif n < 1:
                depths.append(depth_entry(depth, status="skipped", reason=(
                    f"the text has {len(tokens)} tokens, fewer than one window of {depth}")))
            else:
                todo.append((depth, n))
                depths.append(None)
        base: dict[int, Any] = {}
        missing = []
        for depth, n in todo:
            cached = read_json(job.cache / f"tf-ctx{depth}.json")
            if cached is not None and cached.get("chunks") == n:
                base[depth] = cached
            else:
                missing.append((depth, n))
        if missing:
            async with servers.baseline_backend(job) as bb:
                async with servers.session(bb.base_url) as bs:
                    for depth, n in missing:
                        first = await _windows_logprobs(bb, bs, tokens, depth, n, k)
                        again = await _windows_logprobs(bb, bs, tokens, depth, n, k)
                        self_check = _drift(_int_keys(first), _int_keys(again), tokens, depth)
                        doc = {"chunks": n, "windows": [[{str(t): v for t, v in p.items()} for p in w] for w in first],
                               "self": _drift_fields(self_check), "measured_by": job.label}
                        write_json(job.cache / f"tf-ctx{depth}.json", doc)
                        base[depth] = doc
                        job.measured.append(f"teacher-forced depth {depth}")
        for depth, n in todo:
            doc = base[depth]
            bw = _int_keys(doc["windows"])
            cand = await _windows_logprobs(job.backend, session, tokens, depth, n, k)
            d = _drift(bw, cand, tokens, depth)
            entry = depth_entry(depth, chunks=n, **_drift_fields(d),
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
