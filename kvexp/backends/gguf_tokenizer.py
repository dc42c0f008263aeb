"""llama.cpp's tokenizer over a GGUF file, for a backend that serves the file but has no tokenizer
endpoint (Ollama): a short-lived llama-server (kvexp's own build, or one on PATH) on loopback, in its
own process group, with the smallest context, one thread and no GPU layers, asked only /tokenize.
It runs before a job's first level and is stopped before it, so nothing of it lands in a measurement.

`exact_units` finds text units that count as one token each in the file's vocabulary
(prompts.text_units) and measures on the serving server itself what it adds to a prompt (a BOS, a
chat template): two prompts of different lengths must differ by exactly their difference, or the
server's tokenizer does not count as llama.cpp's does and the units are not used."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional, Union

import aiohttp

from kvexp.assets.install import find_llama_server
from kvexp.backends.base import BackendError, answer_json, connector
from kvexp.backends.process import ServerProcess, free_port
from kvexp.workload import prompts

HOST = "127.0.0.1"
CONTEXT = 64  # -c: the server decodes nothing
READY_S = 120.0
PROBE_UNITS = (8, 24)  # the lengths of the two prompts that measure what the server adds
LOG_NAME = "tokenizer.log"  # in the job's folder


class GGUFTokenizer:
    """`async with GGUFTokenizer(program, gguf, log) as tok: await tok.pieces(text)`."""

    def __init__(self, program: Path, gguf: Path, log_path: Path):
        self.program, self.gguf, self.log_path = Path(program), Path(gguf), log_path
        self.proc: Optional[ServerProcess] = None
        self.session: Optional[aiohttp.ClientSession] = None
        self.url = ""

    @property
    def source(self) -> str:
        return f"llama.cpp's /tokenize ({self.program.name}) over {self.gguf.name}"

    async def __aenter__(self) -> "GGUFTokenizer":
        port = free_port(HOST)
        argv = [str(self.program), "-m", str(self.gguf), "--host", HOST, "--port", str(port), "-c", str(CONTEXT),
                "-np", "1", "-t", "1", "-ngl", "0", "--no-warmup"]
        # llama-server reads every LLAMA_ARG_* variable as a flag: none of the user's reaches this one
        unset = [k for k in os.environ if k.startswith("LLAMA_ARG_")]
        self.proc = ServerProcess(argv, {}, self.log_path, "tokenizer llama-server", grace_s=5.0, unset=unset)
        self.proc.start()
        self.url = f"http://{HOST}:{port}"
        try:
            await asyncio.to_thread(self.proc.wait_ready, self.url + "/health", READY_S)
        except BaseException:
            await asyncio.to_thread(self.proc.stop)
            raise
        self.session = aiohttp.ClientSession(connector=connector(1), timeout=aiohttp.ClientTimeout(total=60))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.session is not None:
            await self.session.close()
        if self.proc is not None:
            await asyncio.to_thread(self.proc.stop)

    async def pieces(self, text: str) -> list[tuple[int, str]]:
        """The tokens of `text` (no BOS): (id, the token's text; "" where it is not whole UTF-8)."""
        assert self.session is not None
        async with self.session.post(self.url + "/tokenize",
                                     json={"content": text, "add_special": False, "with_pieces": True}) as r:
            if r.status != 200:
                raise BackendError(f"{self.source}: /tokenize answered HTTP {r.status}")
            tokens = (await answer_json(r, tokens=list))["tokens"]
        out = []
        for t in tokens:
            if not (isinstance(t, dict) and isinstance(t.get("id"), int)):
                raise BackendError(f"{self.source}: /tokenize answered a token that is not {{id, piece}}: {t!r:.80}")
            piece = t.get("piece")
            out.append((t["id"], piece if isinstance(piece, str) else ""))
        return out


# what the serving server counts for a text sent through an API: (text, api) -> its prompt tokens
Counter = Callable[[str, str], Awaitable[int]]


async def exact_units(gguf: Path, api: str, seed: int, log_dir: Path,
                      count: Counter) -> Union[prompts.TextUnits, str]:
    """One-token text units of the GGUF's vocabulary with what the serving server adds to a prompt of
    `api` (measured with `count`), or why there are none (prompts then stay estimated text)."""
    program = find_llama_server()
    if program is None:
        return ("llama-server is not installed (`python -m kvexp install llamacpp`): kvexp reads the GGUF's "
                "vocabulary with it")
    tok = GGUFTokenizer(program, gguf, log_dir / LOG_NAME)
    try:
        async with tok:
            units = await prompts.text_units(tok.pieces, seed, tok.source)
    except (BackendError, aiohttp.ClientError, asyncio.TimeoutError) as e:
        return f"{tok.source}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    if units is None:
        return f"{tok.source}: no text units that count as one token each however they are joined"
    checks = []
    for n in PROBE_UNITS:
        checks.append((n, await count(units.text(n, f"probe:{seed}:{n}"), api)))
    added = {c - n for n, c in checks}
    if len(added) != 1 or min(added) < 0:
        said = ", ".join(f"{c} for {n}" for n, c in checks)
        return f"the server counted {said} units of text: its tokenizer does not count as {tok.source}"
    return replace(units, added=added.pop(), checks=tuple(checks))
