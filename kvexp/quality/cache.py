"""The baseline cache: the baseline's outputs are measured once per (backend, model file hash, server
build, settings) and kept under kvexp's cache dir, so a sweep over four KV dtypes measures the
baseline once. Here: the baseline's KV definition, what its outputs depend on (the key), file hashes
and the cache's JSON files."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional

import yaml

from kvexp.core.config import ExperimentConfig, KVConfig
from kvexp.core.paths import atomic_write, cache_dir, data_dir, sha256_of
from kvexp.results.documents import JobResult

HASH_MEMO_BYTES = 64 << 20  # files this big have their hash remembered in the cache dir too
_HASHES: dict[tuple, str] = {}


def baseline_kv(name: str, like: KVConfig) -> KVConfig:
    """The baseline KV dtype's definition, read from conf/kv/<name>.yaml (the one place its
    per-backend names live), as a copy of `like` (the job's KV config) with that file's fields."""
    path = data_dir("conf") / "kv" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"quality.baseline={name}: no such KV option (conf/kv/{name}.yaml)")
    d = yaml.safe_load(path.read_text()) or {}
    known = {f.name for f in dataclasses.fields(like)}
    return dataclasses.replace(like, **{k: v for k, v in d.items() if k in known})


def quality_cache_dir() -> Path:
    """Where baselines are kept: $KVEXP_QUALITY_CACHE, else kvexp's cache dir / quality."""
    return Path(os.environ.get("KVEXP_QUALITY_CACHE") or cache_dir() / "quality")


def key_parts(cfg: ExperimentConfig, res: JobResult, backend: Any, text_sha: str, base_dtype: str,
              perplexity: Optional[Path]) -> dict[str, Any]:
    """What the baseline's outputs depend on: backend, model file, server build, the numerics settings
    that apply to the baseline's KV dtype, the text and the measurement settings; for a backend whose
    teacher-forced drift comes from llama-perplexity, that program's build (`perplexity`: its path,
    None when it is not found)."""
    q = cfg.quality
    parts: dict[str, Any] = {
        "backend": backend.name, "model_sha256": model_sha256(backend.model_path),
        "model": backend.model_path,
        "server_build": res.backend.version, "text_sha256": text_sha,
        "settings": {k: getattr(q, k) for k in ("chunks", "prompts", "prompt_tokens", "max_tokens", "top_k",
                                                 "seed", "baseline")},
    }
    if backend.teacher_forced == "perplexity_tool":
        parts["perplexity_sha256"] = file_sha256(perplexity) if perplexity else None
    numerics = backend.numerics(base_dtype)
    if numerics:
        parts["numerics"] = numerics
    return parts


def cache_key(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def file_sha256(path: Path) -> str:
    """sha256 of a file, remembered per path, size and mtime: for this process, and for large files
    (a model of many GB takes a while to hash) in the quality cache's hashes.json."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _HASHES:
        return _HASHES[key]
    memo_path = quality_cache_dir() / "hashes.json"
    memo_key = "|".join(map(str, key))
    memo = (read_json(memo_path) or {}) if st.st_size >= HASH_MEMO_BYTES else {}
    digest = memo.get(memo_key)
    if digest is None:
        digest = sha256_of(path)
        if st.st_size >= HASH_MEMO_BYTES:
            try:
                write_json(memo_path, {**memo, memo_key: digest})
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


def read_json(path: Path) -> Optional[dict[str, Any]]:
    """A cache file's document; None when it is missing or unreadable (then it is measured again)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(doc, allow_nan=False))
