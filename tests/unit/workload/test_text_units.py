"""Exact-text prompts for a backend without a tokenizer endpoint (kvexp.workload.prompts.text_units):
units of one token each, found with a tokenizer of the model's vocabulary before the levels and
checked where they stand in text; here against fake tokenizers (the real ones:
tests/integration/ollama/test_ollama_real.py)."""

from __future__ import annotations

import asyncio
import random
import re

from conftest import TINY

from kvexp.workload import prompts
from kvexp.workload.prompts import TextUnits, text_units, unstable_units

SEED = 3


class FakeTokenizer:
    """Pre-tokenizes like a byte-level BPE (` ?[a-z]+`, anything else alone); a pre-token in `vocab` is
    one token, any other splits into characters. A glue word takes the next word into its token (a
    merge across a boundary); `lead` is put before every text (a space prefix)."""

    def __init__(self, vocab: set[str], glue: set[str] = frozenset(), lead: str = ""):
        self.vocab, self.lead, self.ids = {" " + w for w in vocab}, lead, {}
        glued = [re.escape(" " + g) + r" [a-z]+" for g in sorted(glue)]
        self.pattern = re.compile("|".join([*glued, r" ?[a-z]+", r"."]), re.S)
        self.glued = {" " + g for g in glue}

    def _id(self, piece: str) -> int:
        return self.ids.setdefault(piece, len(self.ids))

    async def pieces(self, text: str) -> list[tuple[int, str]]:
        out = []
        for p in self.pattern.findall(self.lead + text):
            whole = p in self.vocab or len(p) == 1 or any(p.startswith(g + " ") for g in self.glued)
            out += [(self._id(x), x) for x in ([p] if whole else list(p))]
        return out

    def count(self, text: str) -> int:
        return len(asyncio.run(self.pieces(text)))


def corpus_words(n: int) -> list[str]:
    """Words of the corpus text_units tokenizes (so that a fake vocabulary holds some of them)."""
    return prompts.made_up_words(random.Random(SEED), prompts.WORDS_PER_CORPUS)[:n]


def test_word_units_count_one_token_each_and_a_glue_word_is_dropped():
    words = corpus_words(80)
    glue = {words[5], words[17]}
    tok = FakeTokenizer(set(words), glue)
    units = asyncio.run(text_units(tok.pieces, SEED, "fake"))
    assert units is not None and units.lead == 0 and units.source == "fake"
    assert all(u.startswith(" ") for u in units.units)
    assert not {" " + g for g in glue} & set(units.units)
    assert len(units.units) >= len(set(words)) - 3 * len(glue)  # a glue word and at most its two neighbours
    for n in (1, 7, 128, 1000):
        for seed in range(5):
            assert tok.count(units.text(n, seed)) == n
    # a shared prefix and a part of its own add up
    assert tok.count(units.text(40, "p") + units.text(88, 1)) == 128


def test_a_vocabulary_of_characters_gives_letters_after_its_space_prefix():
    tok = FakeTokenizer(set(), lead=" ")  # one character per token, a space before every text
    units = asyncio.run(text_units(tok.pieces, SEED, "chars"))
    assert units is not None and units.lead == 1
    assert all(len(u) == 1 and u.isalpha() for u in units.units)
    for n in (1, 64, 500):
        assert tok.count(units.text(n, n)) == n + 1


def test_no_units_when_nothing_counts_as_one_token():
    async def every_text_one_token(text: str) -> list[tuple[int, str]]:
        return [(0, text)]

    assert asyncio.run(text_units(every_text_one_token, SEED, "x")) is None


def test_unstable_units_names_a_merge_and_its_neighbours_and_reads_a_lead():
    assert unstable_units([9, 1, 2, 3], [1, 2, 3]) == (set(), 1)
    bad, lead = unstable_units([1, 7, 4, 5], [1, 2, 3, 4, 5])  # units 2 and 3 came out as one token
    assert lead == 0 and {1, 2} <= bad and 4 not in bad


def test_traffic_sizes_exact_text_by_what_the_server_adds(tmp_path):
    """A backend whose text_units are known (what Ollama over an imported GGUF gives): each prompt is the
    asked length less what the server adds; a shared prefix counts in it; the result says how."""
    from kvexp.app.compose import compose
    from kvexp.backends.ollama import Ollama
    from kvexp.measure.traffic import Traffic

    units = TextUnits(("a", "b", "c"), lead=0, source="fake", added=2, checks=((8, 10), (24, 26)))

    class Backend:
        capabilities = Ollama.capabilities

        async def text_units(self, session, api, seed, log_dir):
            assert log_dir == tmp_path
            return units

    cfg = compose([*TINY, "scenario.prompt_tokens=64", "scenario.prefix_tokens=16", "scenario.prefix_groups=2"])

    async def build():
        tr = await Traffic.create(Backend(), None, cfg.scenario, tmp_path)  # type: ignore[arg-type]
        return tr, [await tr.prompt(64, g, 100 + i) for i, g in enumerate((0, 1, None))]

    tr, (p0, p1, alone) = asyncio.run(build())
    assert len(p0) == len(p1) == len(alone) == 62 and p0[:16] != p1[:16]
    assert p0[:16] == asyncio.run(tr.prompt(64, 0, 7))[:16]  # a group's prefix is the same for the whole job
    w = tr.describe()
    assert w["prompt_mode"] == "exact text" and w["chars_per_token"] is None
    assert w["text_units"] == {"source": "fake", "units": 3, "lead_tokens": 0, "added_tokens": 2,
                               "checks": [{"units": 8, "server_tokens": 10}, {"units": 24, "server_tokens": 26}]}
    assert "estimated_because" not in w
