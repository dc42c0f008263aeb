"""Synthetic prompts that are unique per request and exactly the asked length, as the server's own
tokenizer counts it.

Completions requests send token ids drawn (seeded) from the ids the server's tokenizer produced for a
corpus of plain words, so the prompt is exactly N tokens by construction and no two requests share a
prefix (no prefix-cache flattery). Chat requests need text: words are added or removed until the
server's count of the templated message is exactly N. Backends without a tokenizer (Ollama) get
text of an estimated length, and the realised length is recorded from the server's own count. The
words are made up (made_up_words), seeded; the example files kvexp ships are written from them too."""

from __future__ import annotations

import random
from typing import Optional, Protocol

import aiohttp

WORDS_PER_CORPUS = 3000
CHARS_PER_TOKEN = 4.0  # the estimate for a backend without a tokenizer


def made_up_words(rng: random.Random, n: int) -> list[str]:
    """n made-up lowercase words of 2 to 8 letters (prompts and example files)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(n)]


class Tokenizing(Protocol):
    async def tokenize(self, session: aiohttp.ClientSession, text: str) -> list[int]: ...


async def token_pool(backend: Tokenizing, session: aiohttp.ClientSession, seed: int) -> list[int]:
    ids = await backend.tokenize(session, " ".join(made_up_words(random.Random(seed), WORDS_PER_CORPUS)))
    pool = sorted(set(ids))
    if len(pool) < 8:
        raise RuntimeError(f"the server's tokenizer gave only {len(pool)} distinct tokens for the prompt corpus")
    return pool


def token_prompts(pool: list[int], n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.choice(pool) for _ in range(length)] for _ in range(n)]


async def exact_text(count, target: int, rng: random.Random,
                     session: aiohttp.ClientSession) -> Optional[str]:
    """Text whose server-side token count (`await count(session, text)`) is exactly `target`:
    a binary search over whole words, then topped up with one-character words, then with characters
    joined to the last word (where a word costs two tokens, a space and itself, only that reaches an odd
    remainder)."""
    head, *pad = made_up_words(rng, target + 17)  # random words: no two prompts share a beginning
    lo, hi = 0, len(pad)
    while lo < hi:  # the most words that stay within target
        mid = (lo + hi + 1) // 2
        if await count(session, " ".join([head, *pad[:mid]])) <= target:
            lo = mid
        else:
            hi = mid - 1
    words = [head, *pad[:lo]]
    n = await count(session, " ".join(words))
    for filler in ("a", "b", ".", ","):
        while n < target:
            c = await count(session, " ".join([*words, filler]))
            if c > target:
                break
            words.append(filler)
            n = c
    for filler in ("a", ".", "x", "q"):
        while n < target:
            c = await count(session, " ".join([*words[:-1], words[-1] + filler]))
            if c > target or c == n:
                break
            words[-1] += filler
            n = c
    return " ".join(words) if n == target else None


def estimated_text(n: int, length: int, seed: int, chars_per_token: float = CHARS_PER_TOKEN) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [f"r{i}x{rng.randrange(10**9)}"]
        chars = max(1, round(length * chars_per_token))
        while sum(len(w) + 1 for w in words) < chars:
            words.extend(made_up_words(rng, 8))
        out.append(" ".join(words)[:chars].rstrip() or words[0][:chars])
    return out
