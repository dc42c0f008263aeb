"""The servers a quality measurement talks to: HTTP to the job's own server, and the baseline's
server (the job's own when the job is the baseline, else one launched for it)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from typing import Any, AsyncIterator, Iterator

import aiohttp

from kvexp import backends
from kvexp.backends.base import connector
from kvexp.backends.pool import ServerPool
from kvexp.quality.job import QualityJob

log = logging.getLogger("kvexp")


def session(base_url: str) -> aiohttp.ClientSession:
    """A session for one server's quality requests (URLs are absolute; base_url names the server)."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800), connector=connector())


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url, json=body) as r:
        text = await r.text()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status} from {url}: {text[:300]}")
        return json.loads(text)


@contextlib.asynccontextmanager
async def baseline_backend(job: QualityJob) -> AsyncIterator[Any]:
    """A backend whose server runs the baseline KV dtype: the job's own server when the job is the
    baseline, else a server kvexp launches for it now (same backend settings and model), stopped
    afterwards; its log is the job folder's baseline-server.log."""
    if job.is_baseline:
        yield job.backend
        return
    if job.cfg.backend.endpoint:
        raise RuntimeError(f"the baseline (kv={job.base_kv.name}) is not cached and the job is attached to "
                           f"an endpoint: run a kv={job.base_kv.name} job on it first")
    with _launched_baseline(job) as backend:
        yield backend


@contextlib.contextmanager
def _launched_baseline(job: QualityJob) -> Iterator[Any]:
    cfg = dataclasses.replace(job.cfg, kv=job.base_kv)
    backend = backends.create(cfg)
    pool = ServerPool()
    log.info("%s: measuring the kv=%s baseline on a server of its own", job.label, job.base_kv.name)
    server, _ = pool.acquire(backend, cfg, job.out_dir / "baseline-server.log")
    backend.base_url = server.base_url
    try:
        yield backend
    finally:
        pool.release()
