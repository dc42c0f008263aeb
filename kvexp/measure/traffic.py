"""What each level sends, built against the server it is sent to: the scenario's workload
(kvexp/workload/: lengths, shared prefixes, conversations, a dataset or a trace) made into requests
of exact lengths as the server's own tokenizer counts them.

Four ways to make a prompt, chosen by what the backend can do: token ids drawn from the ids the
server's tokenizer produced (completions API, a tokenizer endpoint: exact by construction), text made
exact by counting the server's templated message (chat API), text made of units of one token each
(no tokenizer endpoint, but the model's vocabulary read before the levels: Adapter.text_units), or
text of an estimated length (no tokenizer: the realised length is the server's own count). Every level draws fresh unique parts
(a job-wide counter); shared prefixes are the same for the whole job, and a dataset's or a trace's
prompts are the file's own in every level, so the runner resets the server's cache before each level
where the backend allows it (and the level is flagged where it could not)."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import aiohttp

from kvexp.backends.base import Adapter, Request
from kvexp.core.config import ConfigError, ScenarioConfig
from kvexp.metrics.records import RequestRecord
from kvexp.workload import prompts, scenario
from kvexp.workload.dataset import Entry, Message, load_dataset
from kvexp.workload.files import resolve_path
from kvexp.workload.lengths import dist_json, sample_lengths
from kvexp.workload.prefixes import prefix_groups_of, prefix_tokens_of
from kvexp.workload.trace import TraceRow, trace_offsets, trace_prompt, trace_rows

Prompt = Any  # token ids, a text, or chat messages [{"role", "content"}]
OUTPUT_SEED = 500_009  # output lengths are drawn from another stream than prompt lengths (seed + this)


@dataclass
class LevelWork:
    """A level's requests (single turn) or conversations (multi-turn), and a trace's own arrival times."""

    requests: list[tuple[Request, RequestRecord]] = field(default_factory=list)
    conversations: list["Conversation"] = field(default_factory=list)
    offsets_s: Optional[list[float]] = None

    @property
    def size(self) -> int:
        """Requests the level asks to send (every turn of every conversation)."""
        return len(self.requests) + sum(c.turns for c in self.conversations)


class Traffic:
    """Builds every level's work for one job (one server)."""

    def __init__(self, backend: Adapter, session: aiohttp.ClientSession, s: ScenarioConfig,
                 pool: Optional[list[int]]):
        self.backend, self.session, self.s, self.pool = backend, session, s, pool
        self.exact = backend.capabilities.exact_prompts
        self.cache = scenario.reuses_cache(s)  # ask the server to keep prompts (llama.cpp cache_prompt)
        self.counter = 0
        self._prefixes: dict[int, Prompt] = {}
        self.entries: list[Entry] = []
        self.left_out = 0  # dataset entries over prompt_tokens
        self._reply_tokens: dict[str, int] = {}  # a dataset reply's length, as the server counts it
        self.rows: list[TraceRow] = []
        # estimated text: characters per token as measured on the server (None: prompts.CHARS_PER_TOKEN)
        self.probe: Optional[tuple[float, int, int]] = None
        self.units: Optional[prompts.TextUnits] = None  # text of one-token units (no tokenizer endpoint)
        self.note: Optional[str] = None  # why prompts are estimated text where the backend could make them exact

    @classmethod
    async def create(cls, backend: Adapter, session: aiohttp.ClientSession, s: ScenarioConfig,
                     log_dir: Path) -> "Traffic":
        """log_dir: the job's folder (a tokenizer helper's log goes there)."""
        pool = None
        if s.api == "completions" and backend.capabilities.exact_prompts:
            pool = await prompts.token_pool(backend, session, s.seed)
        self = cls(backend, session, s, pool)
        if not self.exact and not s.dataset:  # a dataset's prompts are the file's own text
            units = await backend.text_units(session, s.api, s.seed, log_dir)
            if isinstance(units, prompts.TextUnits):
                self.units = units
            else:
                self.note = units
        if not self.exact and self.units is None:
            self.probe = await backend.chars_per_token(session)
        if s.trace:  # token-id prompts: app/checks.check_config refuses a trace without them
            self.rows = trace_rows(s)
        if s.dataset:
            await self._load_dataset()
        return self

    # ---- what the result records of the workload
    def describe(self) -> dict[str, Any]:
        s = self.s
        out: dict[str, Any] = {
            "kind": scenario.kind(s),
            "prompt_dist": dist_json(s.prompt_dist, s.prompt_tokens),
            "output_dist": dist_json(s.output_dist, s.max_tokens),
            "prefix_tokens": s.prefix_tokens, "prefix_groups": s.prefix_groups if s.prefix_tokens else None,
            "turns": s.conversation.turns, "think_time_s": s.conversation.think_time_s,
            "prompt_mode": ("dataset text" if s.dataset else "token ids" if self.pool is not None else
                            "exact text" if self.exact or self.units is not None else "estimated text"),
            "chars_per_token": None if self.probe is None else {
                "value": round(self.probe[0], 4), "probe_chars": self.probe[1], "probe_tokens": self.probe[2]},
            "server_prompt_cache": self.cache,
            "dataset": None, "trace": None,
        }
        if self.units is not None:
            out["text_units"] = self.units.to_json()
        if self.note is not None:
            out["estimated_because"] = self.note
        if s.dataset:
            out["dataset"] = {"file": str(resolve_path(s.dataset)), "entries": len(self.entries),
                              "left_out_over_prompt_tokens": self.left_out}
        if s.trace:
            offsets = trace_offsets(self.rows, s.time_scale)
            out["trace"] = {"file": str(resolve_path(s.trace)), "rows": len(self.rows),
                            "time_scale": s.time_scale, "span_s": round(offsets[-1], 3) if offsets else None,
                            "block_tokens": s.trace_block_tokens}
        return out

    # ---- a level's work
    async def level(self, n: int, level: float, repeat: int, warmup: bool = False) -> LevelWork:
        s = self.s
        self.counter += 1
        seed = s.seed * 1_000_003 + self.counter
        if s.trace:  # a warm-up sends the trace's first rows, one after another
            return await self._trace_level(level, repeat, n if warmup else None)
        if s.conversation.turns > 1 and not warmup:
            groups = prefix_groups_of(n, s.prefix_groups, seed) if s.prefix_tokens else [None] * n
            return LevelWork(conversations=[Conversation(self, i, level, repeat, seed, groups[i]) for i in range(n)])
        out = LevelWork()
        if s.dataset:
            for i in range(n):
                entry = self.entries[i % len(self.entries)]
                drawn = sample_lengths(s.output_dist, s.max_tokens, 1, seed * 7919 + i)[0]
                rec = RequestRecord(index=i, level=level, repeat=repeat, warmup=warmup, source_line=entry.line,
                                    max_tokens=await self.output_length(entry.output_tokens, entry.reply, drawn))
                out.requests.append((self.request(self._entry_prompt(entry.messages), rec), rec))
            return out
        lengths = sample_lengths(s.prompt_dist, s.prompt_tokens, n, seed)
        outputs = sample_lengths(s.output_dist, s.max_tokens, n, seed + OUTPUT_SEED)
        groups = prefix_groups_of(n, s.prefix_groups, seed) if s.prefix_tokens else [None] * n
        for i in range(n):
            rec = RequestRecord(index=i, level=level, repeat=repeat, warmup=warmup, prefix_group=groups[i],
                                target_prompt_tokens=lengths[i], max_tokens=outputs[i])
            prompt = await self.prompt(lengths[i], groups[i], seed * 7919 + i)
            out.requests.append((self.request(prompt, rec), rec))
        return out

    def request(self, prompt: Prompt, rec: RequestRecord) -> Request:
        return self.backend.request(prompt, rec.max_tokens, self.s.api, cache=self.cache)

    async def _trace_level(self, level: float, repeat: int, warmup: Optional[int] = None) -> LevelWork:
        """The trace's rows on their own times; a warm-up (warmup: how many) its first rows, untimed."""
        s, out = self.s, LevelWork()
        assert self.pool is not None
        for i, row in enumerate(self.rows if warmup is None else self.rows[:warmup]):
            rec = RequestRecord(index=i, level=level, repeat=repeat, warmup=warmup is not None, source_line=row.line,
                                target_prompt_tokens=row.input_length, max_tokens=row.output_length)
            ids = trace_prompt(row, self.pool, s.trace_block_tokens, s.seed, i)
            out.requests.append((self.request(ids, rec), rec))
        if warmup is None:
            out.offsets_s = trace_offsets(self.rows, s.time_scale)
        return out

    # ---- prompts
    @property
    def chars_per_token(self) -> float:
        return prompts.CHARS_PER_TOKEN if self.probe is None else self.probe[0]

    async def prompt(self, length: int, group: Optional[int], seed: int) -> Prompt:
        """A prompt of `length` tokens: group's shared prefix (if any), then a part of its own."""
        s = self.s
        prefix = None if group is None else await self._prefix(group)
        if self.pool is not None:
            rest = prompts.token_prompts(self.pool, 1, length - (s.prefix_tokens if prefix else 0), seed)[0]
            return (prefix or []) + rest
        if self.units is not None:  # the server adds units.added (a BOS, a chat template)
            own = length - self.units.added - (s.prefix_tokens if prefix else 0)
            return (prefix or "") + self.units.text(max(1, own), seed)
        lead = f"{prefix} " if prefix else ""
        if self.exact:
            async def count(session: aiohttp.ClientSession, text: str) -> int:
                return await self.backend.chat_prompt_tokens(session, lead + text)

            text = await prompts.exact_text(count, length, random.Random(seed), self.session)
            if text is None:
                raise RuntimeError(f"could not build a chat prompt of exactly {length} tokens")
            return lead + text
        return lead + prompts.estimated_text(1, max(1, length - (s.prefix_tokens if prefix else 0)), seed,
                                             self.chars_per_token)[0]

    async def _prefix(self, group: int) -> Prompt:
        if group not in self._prefixes:
            s = self.s
            if self.pool is not None:
                self._prefixes[group] = prefix_tokens_of(self.pool, group, s.prefix_tokens, s.seed)
            elif self.units is not None:
                self._prefixes[group] = self.units.text(s.prefix_tokens, f"prefix:{s.seed}:{group}")
            elif self.exact:
                async def count(session: aiohttp.ClientSession, text: str) -> int:
                    return len(await self.backend.tokenize(session, text))

                rng = random.Random(f"prefix:{s.seed}:{group}")
                text = await prompts.exact_text(count, s.prefix_tokens, rng, self.session)
                if text is None:
                    raise RuntimeError(f"could not build a shared prefix of exactly {s.prefix_tokens} tokens")
                self._prefixes[group] = text
            else:
                self._prefixes[group] = prompts.estimated_text(1, s.prefix_tokens, s.seed * 31 + group,
                                                               self.chars_per_token)[0]
        return self._prefixes[group]

    async def user_message(self, length: int, seed: int) -> Prompt:
        """A new user message of `length` tokens (token ids, or text) for a conversation's turn."""
        if self.pool is not None:
            return prompts.token_prompts(self.pool, 1, length, seed)[0]
        if self.units is not None:  # joins a history: nothing is added to it
            return self.units.text(length, seed)
        return await self.prompt(length, None, seed)

    # ---- datasets
    def _entry_prompt(self, messages: tuple[Message, ...]) -> Prompt:
        if self.s.api == "chat":
            return [{"role": m.role, "content": m.content} for m in messages]
        return "\n\n".join(m.content for m in messages)

    async def prompt_length(self, prompt: Prompt) -> int:
        """The server's count of a dataset prompt (an estimate where it has no tokenizer)."""
        if not self.exact:
            text = prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in prompt)
            return max(1, round(len(text) / self.chars_per_token))
        if isinstance(prompt, str):
            return len(await self.backend.tokenize(self.session, prompt))
        return await self.backend.chat_prompt_tokens(self.session, prompt)

    async def _load_dataset(self) -> None:
        s = self.s
        entries = load_dataset(resolve_path(s.dataset or ""))
        self.entries = [e for e in entries
                        if await self.prompt_length(self._entry_prompt(e.messages)) <= s.prompt_tokens]
        self.left_out = len(entries) - len(self.entries)
        if not self.entries:
            raise ConfigError(f"scenario.dataset={s.dataset}: no entry has a prompt of at most "
                              f"scenario.prompt_tokens={s.prompt_tokens} tokens")

    async def output_length(self, given: Optional[int], reply: Optional[str], drawn: int) -> int:
        """Output tokens for a dataset request: the entry's own output_tokens (given), else the length
        of its reply (counted once per job: every level sends the same entries), else the scenario's
        output distribution (drawn); at most scenario.max_tokens."""
        if given is None and reply and reply not in self._reply_tokens:
            self._reply_tokens[reply] = await self.prompt_length(reply)
        n = given if given is not None else self._reply_tokens[reply] if reply else drawn
        return max(1, min(n, self.s.max_tokens))

class Conversation:
    """One multi-turn conversation (loadgen.Conversation): every turn sends the whole history (the
    earlier prompts and the server's own answers) and a new user message. The answer goes back as
    text, as a chat client sends it: with token ids the history is the earlier turn's prompt ids plus
    the server's tokenization of the answer's text (which may differ from the ids it generated), so the
    server can serve at least the earlier prompt from its cache; with the chat API it is the messages so
    far. A dataset entry's conversation replays its user messages after its system messages, each turn
    asking for the length of the entry's own reply to it."""

    def __init__(self, traffic: Traffic, index: int, level: float, repeat: int, seed: int,
                 group: Optional[int]):
        s = traffic.s
        self.traffic, self.index, self.level, self.repeat, self.group = traffic, index, level, repeat, group
        self.seed = seed * 104_729 + index
        rng = random.Random(self.seed)
        self.entry = traffic.entries[index % len(traffic.entries)] if traffic.entries else None
        turns = s.conversation.turns
        self.system: list[Message] = []
        self.replies: list[Optional[str]] = []
        if self.entry is not None:
            turns = min(turns, len(self.entry.user_turns))
            msgs = self.entry.messages
            self.system = list(itertools.takewhile(lambda m: m.role == "system", msgs))
            self.replies = [msgs[i + 1].content if i + 1 < len(msgs) and msgs[i + 1].role == "assistant" else None
                            for i, m in enumerate(msgs) if m.role == "user"]
            self.replies[-1] = self.entry.reply
        self.turns = turns
        mean = s.conversation.think_time_s
        self.think_s = [0.0] + [rng.expovariate(1 / mean) if mean > 0 else 0.0 for _ in range(turns - 1)]
        self.lengths = sample_lengths(s.prompt_dist, s.prompt_tokens, turns, self.seed)
        self.outputs = sample_lengths(s.output_dist, s.max_tokens, turns, self.seed + OUTPUT_SEED)
        self.history: Any = None  # token ids, a text or messages

    async def turn(self, t: int, previous: Optional[RequestRecord]) -> tuple[Request, RequestRecord]:
        tr, s = self.traffic, self.traffic.s
        if previous is not None:
            self.history = await self._with_answer(self.history, "".join(previous.text or []))
        elif self.system:
            self.history = await self._as_history(self.system)
        new = await self._new_message(t)
        if tr.pool is not None:
            prompt = (self.history or []) + new
        elif s.api == "chat":
            prompt = [*(self.history or []), {"role": "user", "content": new}]
        else:
            prompt = f"{self.history}\n\n{new}" if self.history else new
        self.history = prompt
        rec = RequestRecord(index=self.index * s.conversation.turns + t, level=self.level, repeat=self.repeat,
                            conversation=self.index, turn=t, prefix_group=self.group if t == 0 else None,
                            target_prompt_tokens=len(prompt) if tr.pool is not None else None,
                            max_tokens=await self._output(t), text=[] if t + 1 < self.turns else None,
                            source_line=self.entry.line if self.entry else None)
        return tr.request(prompt, rec), rec

    async def _output(self, t: int) -> int:
        """Output tokens of turn t: a dataset entry's own for that turn (Traffic.output_length; its
        output_tokens counts for its last turn), else the scenario's output distribution."""
        if self.entry is None:
            return self.outputs[t]
        given = self.entry.output_tokens if t == len(self.replies) - 1 else None
        return await self.traffic.output_length(given, self.replies[t], self.outputs[t])

    async def _as_history(self, messages: list[Message]) -> Any:
        tr = self.traffic
        if tr.s.api == "chat":
            return [{"role": m.role, "content": m.content} for m in messages]
        text = "\n\n".join(m.content for m in messages)
        return await tr.backend.tokenize(tr.session, text) if tr.pool is not None else text

    async def _new_message(self, t: int) -> Any:
        tr = self.traffic
        if self.entry is not None:
            text = self.entry.user_turns[t]
            return await tr.backend.tokenize(tr.session, text) if tr.pool is not None else text
        if t == 0:
            return await tr.prompt(self.lengths[0], self.group, self.seed * 7919)
        return await tr.user_message(self.lengths[t], self.seed * 7919 + t)

    async def _with_answer(self, history: Any, answer: str) -> Any:
        tr = self.traffic
        if tr.pool is not None:
            return history + (await tr.backend.tokenize(tr.session, answer) if answer else [])
        if tr.s.api == "chat":
            return [*history, {"role": "assistant", "content": answer}]
        return f"{history}{answer}"
