"""A quality measurement's inputs, checked before any server starts: the evaluation text (UTF-8 text,
not binary, long enough for the shallowest depth), the depths (within the model's trained context,
where its files state one) and the server (one kvexp launches: the KV dtype of an attached server is
not kvexp's to set, and llama-perplexity would read a local file, not that server's model)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from kvexp.assets import evaltext
from kvexp.capacity.planner import ModelArch
from kvexp.core.config import MAX_TOKENS, ConfigError, ExperimentConfig
from kvexp.core.paths import file_problem

MAX_TEXT_BYTES = 64 << 20  # an evaluation text larger than this is not one (kvexp's own is 0.2 MB)


def check_inputs(cfg: ExperimentConfig, arch: Optional[ModelArch]) -> None:
    """Raise ConfigError (one line naming the setting) for quality inputs that cannot give a figure."""
    q = cfg.quality
    if cfg.backend.endpoint:
        raise ConfigError(f"quality with backend.endpoint={cfg.backend.endpoint}: kvexp cannot set an attached "
                          "server's KV dtype, so it cannot measure what one costs; let kvexp launch the server")
    ctx = arch.context_length_tokens if arch is not None else None
    limit, why = (ctx, f"model={cfg.model.name}'s trained context") if ctx else (MAX_TOKENS, "kvexp's limit")
    deep = [d for d in q.depths if d > limit]
    if deep:
        raise ConfigError(f"quality.depths={list(q.depths)}: {deep[0]:,} is beyond {why} of {limit:,} tokens")
    name = f"quality.text={q.text}" if q.text else "kvexp's evaluation text"
    path = Path(q.text).expanduser() if q.text else evaltext.SHIPPED
    problem = file_problem(path)
    if problem:
        raise ConfigError(f"{name}: {problem}")
    if path.stat().st_size > MAX_TEXT_BYTES:
        raise ConfigError(f"{name}: {path.stat().st_size:,} bytes, over the {MAX_TEXT_BYTES >> 20} MiB of an "
                          "evaluation text")
    data = path.read_bytes()
    nul = data.find(b"\0")
    if nul >= 0:
        raise ConfigError(f"{name}: binary data (a NUL byte at offset {nul:,}), not text")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{name}: not UTF-8 (byte {data[e.start]:#04x} at offset {e.start:,}); convert it, "
                          "e.g. iconv -f latin1 -t utf-8") from None
    shallowest = min(q.depths)
    if len(text) < 2 * shallowest:  # a token is at least one character
        raise ConfigError(f"{name}: {len(text):,} characters, fewer than the {2 * shallowest:,} tokens the "
                          f"shallowest depth ({shallowest}) needs (llama-perplexity reads twice the depth)")
