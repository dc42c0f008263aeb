"""Synthetic prompts that are unique per request and exactly the asked length, as the server's own
tokenizer counts it.

Completions requests send token ids drawn (seeded) from the ids the server's tokenizer produced for a
corpus of plain words, so the prompt is exactly N tokens by construction and no two requests share a
prefix (no prefix-cache flattery). Chat requests need text: words are added or removed until the
server's count of the templated message is exactly N. A backend without a tokenizer endpoint whose
model's vocabulary kvexp can still read (Ollama serving a GGUF kvexp imports: llama.cpp's tokenizer
over the same file, before the levels) gets text made of units that each count as one token
(`text_units`), N of them less what the server adds (a BOS, a chat template), as measured on the
server; one it cannot read gets text of an estimated length, and the realised length is recorded
from the server's own count. The words are made up (made_up_words), seeded; the example files kvexp
ships are written from them too."""

from __future__ import annotations

import difflib
import random
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional, Protocol

import aiohttp

WORDS_PER_CORPUS = 3000
CHARS_PER_TOKEN = 4.0  # the estimate for a backend without a tokenizer
MIN_UNITS = 8  # fewer one-token units than this: no exact text
UNIT_ROUNDS = 8  # shuffles of the units tried at most, until CLEAN_ROUNDS in a row keep every unit
CLEAN_ROUNDS = 2


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


Pieces = Callable[[str], Awaitable[list[tuple[int, str]]]]  # a text -> its tokens (id, text of the token)


@dataclass(frozen=True)
class TextUnits:
    """Pieces of text that each count as one token of the served model, however they are joined: a
    word with its leading space (" ab" in a byte-level BPE vocabulary), or a character (a vocabulary of
    one character per token). `added` is what the server counts beside the text (a BOS, a chat
    template), measured on the server; `lead` what the tokenizer itself puts before a text (a space
    prefix), part of `added` on the server."""

    units: tuple[str, ...]
    lead: int
    source: str  # the tokenizer that counted them
    added: int = 0
    checks: tuple[tuple[int, int], ...] = ()  # (units sent, tokens the server counted) of the server's probes

    def text(self, tokens: int, seed: int | str) -> str:
        """Text of exactly `tokens` units (seeded: no two seeds share more than a unit's beginning)."""
        rng = random.Random(seed)
        return "".join(rng.choice(self.units) for _ in range(tokens))

    def to_json(self) -> dict:
        return {"source": self.source, "units": len(self.units), "lead_tokens": self.lead,
                "added_tokens": self.added,
                "checks": [{"units": u, "server_tokens": c} for u, c in self.checks]}


async def text_units(pieces: Pieces, seed: int, source: str) -> Optional[TextUnits]:
    """One-token units of the vocabulary behind `pieces`, found in its tokenization of a corpus of
    made-up words: the word-start tokens (a space and letters), else the letters of a vocabulary that
    has too few of them. Every unit is then checked where it stands in text: all the units, shuffled,
    are tokenized together and those whose tokens are not their own one (a merge across a boundary) are
    dropped, until CLEAN_ROUNDS shuffles in a row keep every unit and the tokens the tokenizer puts
    before the text stay the same; None when that does not happen within UNIT_ROUNDS, or too few
    units are left."""
    corpus = " ".join(made_up_words(random.Random(seed), WORDS_PER_CORPUS))
    seen = {piece: tid for tid, piece in await pieces(corpus)}
    spaced = {p: t for p, t in seen.items() if len(p) > 1 and p[0] == " " and _letters(p[1:])}
    units = spaced if len(spaced) >= MIN_UNITS else {p: t for p, t in seen.items() if _letters(p)}
    rng = random.Random(f"units:{seed}")
    leads: set[int] = set()
    clean = 0
    for _ in range(UNIT_ROUNDS):
        if len(units) < MIN_UNITS:
            return None
        order = sorted(units)
        rng.shuffle(order)
        ids = [tid for tid, _ in await pieces("".join(order))]
        bad, lead = unstable_units(ids, [units[u] for u in order])
        if bad:
            for i in bad:
                units.pop(order[i], None)
            clean = 0
            continue
        leads.add(lead)
        clean += 1
        if clean == CLEAN_ROUNDS:
            return TextUnits(tuple(sorted(units)), lead, source) if len(leads) == 1 else None
    return None


def unstable_units(ids: list[int], expected: list[int]) -> tuple[set[int], int]:
    """(positions in `expected` whose token is not its own in `ids`, with their neighbours: a merge
    spans a boundary; tokens before the first unit). `expected` holds one token per unit."""
    bad: set[int] = set()
    lead = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, ids, expected, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        if tag == "delete" and i1 == 0 and j1 == j2 == 0:  # what the tokenizer puts before any text
            lead = i2
            continue
        bad.update(range(max(j1 - 1, 0), min(j2 + 1, len(expected))))
    return bad, lead


def _letters(text: str) -> bool:
    return text.isascii() and text.isalpha()
