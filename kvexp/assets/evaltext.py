"""The evaluation text quality measurements run on: plain English prose generated from a word list
written for kvexp and a small grammar, deterministic from a seed, so it carries no one else's
copyright (it is released with kvexp under kvexp's MIT licence). `kvexp/assets/evaltext.txt` is this
generator's output for the default seed and length; `python -m kvexp.assets.evaltext` rewrites it.

It is text a language model can read as text (words, sentences, paragraphs, punctuation), not a
benchmark of knowledge: quality measurements compare a KV dtype with the 16-bit KV cache on the same
text, so what matters is that the text is fixed, long enough for the deepest context measured
(llama-perplexity needs twice the context in tokens) and varied enough not to be trivially
predictable. A user's own text replaces it with `quality.text=PATH`."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

DEFAULT_SEED = 14
DEFAULT_CHARS = 60_000  # ~60k characters: about 13k tokens for a BPE tokenizer, 60k for a character one
SHIPPED = Path(__file__).with_name("evaltext.txt")

NAMES = ("Ada", "Bram", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kira",
         "Luca", "Mara", "Nils", "Olga", "Pavel", "Rosa", "Sami", "Tara", "Viktor")
PLACES = ("the harbour", "the old mill", "the market", "the station", "the library", "the bridge",
          "the orchard", "the workshop", "the hill above the town", "the river bank", "the bakery",
          "the school", "the square", "the forest road", "the lighthouse", "the garden")
NOUNS = ("lamp", "letter", "boat", "key", "map", "basket", "clock", "window", "coat", "book", "bicycle",
         "kettle", "ladder", "rope", "bell", "box", "song", "story", "question", "plan", "storm", "road",
         "door", "field", "stone", "cup", "loaf", "wheel", "engine", "picture", "table", "fence")
ADJECTIVES = ("old", "small", "heavy", "bright", "quiet", "broken", "warm", "narrow", "green", "strange",
              "careful", "tired", "empty", "wooden", "late", "patient", "cold", "simple", "long", "new")
VERBS_PAST = ("found", "carried", "painted", "opened", "mended", "watched", "lost", "borrowed", "measured",
              "cleaned", "counted", "described", "followed", "hid", "moved", "sold", "wrapped", "built")
VERBS_INTRANS = ("waited", "laughed", "listened", "hurried", "rested", "worked", "wondered", "paused",
                 "smiled", "slept", "returned", "stayed")
TIMES = ("in the morning", "before noon", "after dinner", "at dusk", "on Sunday", "the next day",
         "late at night", "that winter", "in early spring", "every evening", "once a week")
CONNECT = ("because", "although", "while", "until", "after", "before", "so")
ADVERBS = ("slowly", "carefully", "again", "quietly", "at once", "without a word", "twice", "happily")


def _np(r: random.Random) -> str:
    noun = r.choice(NOUNS)
    if r.random() < 0.6:
        return f"the {r.choice(ADJECTIVES)} {noun}"
    return f"a {noun}" if noun[0] not in "aeiou" else f"an {noun}"


def _clause(r: random.Random) -> str:
    who = r.choice(NAMES)
    kind = r.random()
    if kind < 0.45:
        s = f"{who} {r.choice(VERBS_PAST)} {_np(r)}"
    elif kind < 0.7:
        s = f"{who} {r.choice(VERBS_INTRANS)} at {r.choice(PLACES)}"
    elif kind < 0.85:
        s = f"{_np(r)} was {r.choice(ADJECTIVES)}"
    else:
        s = f"{who} and {r.choice(NAMES)} {r.choice(VERBS_PAST)} {_np(r)} near {r.choice(PLACES)}"
    if r.random() < 0.35:
        s += f" {r.choice(ADVERBS)}"
    if r.random() < 0.3:
        s += f" {r.choice(TIMES)}"
    return s


def _sentence(r: random.Random) -> str:
    s = _clause(r)
    roll = r.random()
    if roll < 0.3:
        s += f" {r.choice(CONNECT)} {_clause(r)}"
    elif roll < 0.45:
        s += f", and {_clause(r)}"
    elif roll < 0.5:
        n = r.randint(2, 19)
        s += f", which took {n} minutes"
    s = s[0].upper() + s[1:]
    end = r.choices([".", "!", "?"], weights=[0.85, 0.07, 0.08])[0]
    if end == "?":
        s = f"Was it true that {s[0].lower() + s[1:] if s.startswith(('The ', 'A ', 'An ')) else s}"
    return s + end


def generate(seed: int = DEFAULT_SEED, chars: int = DEFAULT_CHARS) -> str:
    """Paragraphs of 3-7 sentences until the text holds at least `chars` characters."""
    r = random.Random(seed)
    paragraphs: list[str] = []
    total = 0
    while total < chars:
        p = " ".join(_sentence(r) for _ in range(r.randint(3, 7)))
        paragraphs.append(p)
        total += len(p) + 2
    return "\n\n".join(paragraphs) + "\n"


def load(path: str | Path | None = None) -> tuple[str, str, str]:
    """(text, sha256 of its bytes, where it came from): the shipped text, or the user's file."""
    p = Path(path).expanduser() if path else SHIPPED
    data = p.read_bytes()
    return data.decode("utf-8", errors="replace"), hashlib.sha256(data).hexdigest(), \
        ("kvexp's evaluation text" if path is None else str(p))


if __name__ == "__main__":
    SHIPPED.write_text(generate(), encoding="utf-8")
    print(f"wrote {SHIPPED} ({SHIPPED.stat().st_size} bytes)")
