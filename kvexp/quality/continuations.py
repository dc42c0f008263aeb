"""Greedy-continuation agreement through the serving API, on every backend: N prompts taken from the
evaluation text at offsets drawn from quality.seed, continued at temperature 0 by the baseline (twice:
its own agreement is part of the determinism check, kept in the baseline cache) and by the job."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any, Optional

import aiohttp

from kvexp.core.config import QualityConfig
from kvexp.quality import servers, stats as qs
from kvexp.quality.cache import read_json, write_json
from kvexp.quality.job import QualityJob


def prompt_offsets(n_units: int, length: int, prompts: int, seed: int) -> list[int]:
    """Start offsets of `prompts` prompts of `length` units, drawn from the seed (distinct where the
    text allows)."""
    room = n_units - length
    if room < 1:
        return []
    r = random.Random(seed)
    return r.sample(range(room), prompts) if room >= prompts else [r.randrange(room) for _ in range(prompts)]


def continuation_null(q: QualityConfig, reason: str) -> dict[str, Any]:
    return {"prompts": q.prompts, "prompt_tokens": q.prompt_tokens, "max_tokens": q.max_tokens, "unit": None,
            "identical_share": None, "first_diff_mean": None, "prefix_agreement": None,
            "kld_prefix_mean": None, "top_k": None, "reason": reason}


async def _prompts(job: QualityJob, backend: Any, session: aiohttp.ClientSession) -> list[Any]:
    q = job.q
    if not backend.capabilities.exact_prompts:  # no tokenizer endpoint: text of about 4 characters a token
        n = q.prompt_tokens * 4
        return [job.text[o:o + n] for o in prompt_offsets(len(job.text), n, q.prompts, q.seed)]
    tokens = await backend.tokenize(session, job.text)
    return [tokens[o:o + q.prompt_tokens] for o in prompt_offsets(len(tokens), q.prompt_tokens, q.prompts, q.seed)]


async def _continue_all(job: QualityJob, backend: Any, session: aiohttp.ClientSession,
                        prompts: list[Any]) -> list[dict[str, Any]]:
    out = []
    for i, p in enumerate(prompts):
        req = backend.continuation_request(p, job.q.max_tokens, job.q.top_k, job.q.seed * 1000 + i)
        units, tops = backend.parse_continuation(await servers.post(session, backend.base_url + req.path, req.body))
        out.append({"units": units, "top": [None if t is None else {str(k): v for k, v in t.items()} for t in tops]})
    return out


def _tops(c: dict[str, Any]) -> list[Optional[qs.TopK]]:
    return [None if t is None else qs.TopK({int(k): float(v) for k, v in t.items()}) for t in c["top"]]


def _compare(base: list[dict[str, Any]], cand: list[dict[str, Any]]) -> tuple[qs.ContinuationAgreement,
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


async def continuation(job: QualityJob) -> dict[str, Any]:
    """The `continuation` block of a job (null figures, with the reason, where it could not be measured)."""
    q = job.q
    unit = job.backend.continuation_unit
    path = job.cache / "continuations.json"
    try:
        async with servers.session(job.backend.base_url) as session:
            prompts = await _prompts(job, job.backend, session)
            if not prompts:
                return continuation_null(q, f"the text is shorter than one prompt of {q.prompt_tokens} {unit}s")
            base = read_json(path)
            if base is None or len(base.get("first") or []) != len(prompts):
                async with servers.baseline_backend(job) as bb:
                    async with servers.session(bb.base_url) as bs:
                        first = await _continue_all(job, bb, bs, prompts)
                        again = await _continue_all(job, bb, bs, prompts)
                self_agree, self_kld = _compare(first, again)
                base = {"first": first, "self": {**dataclasses.asdict(self_agree), "kld_prefix_mean": self_kld},
                        "measured_by": job.label}
                write_json(path, base)
                job.measured.append("continuations")
                if job.is_baseline:
                    cand = again
                else:
                    cand = await _continue_all(job, job.backend, session, prompts)
            else:
                cand = await _continue_all(job, job.backend, session, prompts)
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError, KeyError) as e:
        return continuation_null(q, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    agree, kld = _compare(base["first"], cand)
    self_identical = agree.identical_share if job.is_baseline else base["self"]["identical_share"]
    has_top = any(t is not None for c in cand for t in c["top"])
    return {"prompts": agree.prompts, "prompt_tokens": q.prompt_tokens, "max_tokens": q.max_tokens, "unit": unit,
            "identical_share": agree.identical_share, "first_diff_mean": agree.first_diff_mean,
            "prefix_agreement": agree.prefix_agreement, "kld_prefix_mean": kld,
            "top_k": q.top_k if has_top else None,
            "self_identical_share": self_identical,
            "reason": None if has_top else f"{job.backend.name} exposes no log-probabilities of generated "
                                           "tokens here: agreement only"}
