"""What each level sends, built against the server it is sent to: the scenario's workload
(kvexp/workload.py: lengths, shared prefixes, conversations, a dataset or a trace) made into requests
of exact lengths as the server's own tokenizer counts them.

Three ways to make a prompt, chosen by what the backend can do: token ids drawn from the ids the
server's tokenizer produced (completions API, a tokenizer endpoint: exact by construction), text made
exact by counting the server's templated message (chat API), or text of an estimated length (no
tokenizer: the realised length is the server's own count). Every level draws fresh unique parts
(a job-wide counter), so no level is served from another's prompts; shared prefixes are the same
for the whole job, and the runner resets the server's cache before each level."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Optional

import aiohttp

from kvexp import prompts, workload
from kvexp.backends.base import Adapter, Request
from kvexp.config import ConfigError, ScenarioConfig
from kvexp.loadgen import RequestRecord

Prompt = Any  # token ids, a text, or chat messages [{"role", "content"}]


@dataclass
class LevelWork:
    """A level's requests (single turn) or conversations (multi-turn), and a trace's own arrival times."""

    requests: list[tuple[Request, RequestRecord]] = field(default_factory=list)
    conversations: list["Conversation"] = field(default_factory=list)
    offsets_s: Optional[list[float]] = None


class Traffic:
    """Builds every level's work for one job (one server)."""

    def __init__(self, backend: Adapter, session: aiohttp.ClientSession, s: ScenarioConfig,
                 pool: Optional[list[int]]):
        self.backend, self.session, self.s, self.pool = backend, session, s, pool
        self.exact = backend.capabilities.exact_prompts
        self.cache = workload.reuses_cache(s)  # ask the server to keep prompts (llama.cpp cache_prompt)
        self.counter = 0
        self._prefixes: dict[int, Prompt] = {}
        self.entries: list[workload.Entry] = []
        self.left_out = 0  # dataset entries over prompt_tokens
        self.rows: list[workload.TraceRow] = []

    @classmethod
    async def create(cls, backend: Adapter, session: aiohttp.ClientSession, s: ScenarioConfig) -> "Traffic":
        pool = None
        if s.api == "completions" and backend.capabilities.exact_prompts:
            pool = await prompts.token_pool(backend, session, s.seed)
        self = cls(backend, session, s, pool)
        if s.trace:
            if pool is None:
                raise ConfigError(f"scenario.trace: replaying a trace needs token-id prompts: the completions API "
                                  f"of a backend with a tokenizer endpoint ({backend.name} with api={s.api} has none)")
            self.rows = workload.load_trace(workload.resolve_path(s.trace))[:s.requests]
        if s.dataset:
            await self._load_dataset()
        return self

    # ---- what the result records of the workload
    def describe(self) -> dict[str, Any]:
        s = self.s
        out: dict[str, Any] = {
            "kind": workload.kind(s),
            "prompt_dist": workload.dist_json(s.prompt_dist, s.prompt_tokens),
            "output_dist": workload.dist_json(s.output_dist, s.max_tokens),
            "prefix_tokens": s.prefix_tokens, "prefix_groups": s.prefix_groups if s.prefix_tokens else None,
            "turns": s.conversation.turns, "think_time_s": s.conversation.think_time_s,
            "prompt_mode": "token ids" if self.pool is not None else "exact text" if self.exact else "estimated text",
            "server_prompt_cache": self.cache,
            "dataset": None, "trace": None,
        }
        if s.dataset:
            out["dataset"] = {"file": str(workload.resolve_path(s.dataset)), "entries": len(self.entries),
                              "left_out_over_prompt_tokens": self.left_out}
        if s.trace:
            offsets = workload.trace_offsets(self.rows, s.time_scale)
            out["trace"] = {"file": str(workload.resolve_path(s.trace)), "rows": len(self.rows),
                            "time_scale": s.time_scale, "span_s": round(offsets[-1], 3) if offsets else None,
                            "block_tokens": s.trace_block_tokens}
        return out

    def trace_rate(self) -> float:
        """A trace's mean arrival rate at its time scale (requests/s): the value of its one level."""
        offsets = workload.trace_offsets(self.rows, self.s.time_scale)
        span = offsets[-1] if offsets else 0.0
        return round((len(offsets) - 1) / span, 4) if span > 0 else float(len(offsets))

    # ---- a level's work
    async def level(self, n: int, level: float, repeat: int, warmup: bool = False) -> LevelWork:
        s = self.s
        self.counter += 1
        seed = s.seed * 1_000_003 + self.counter
        if s.trace and not warmup:
            return await self._trace_level(level, repeat)
        if s.conversation.turns > 1 and not warmup:
            return LevelWork(conversations=[Conversation(self, i, level, repeat, seed) for i in range(n)])
        out = LevelWork()
        if s.dataset:
            for i in range(n):
                entry = self.entries[i % len(self.entries)]
                rec = RequestRecord(index=i, level=level, repeat=repeat, warmup=warmup, source_line=entry.line,
                                    max_tokens=await self._entry_output(entry, seed, i))
                out.requests.append((self.request(self._entry_prompt(entry.messages), rec), rec))
            return out
        lengths = workload.sample_lengths(s.prompt_dist, s.prompt_tokens, n, seed)
        outputs = workload.sample_lengths(s.output_dist, s.max_tokens, n, seed + 1)
        groups = workload.prefix_groups_of(n, s.prefix_groups, seed) if s.prefix_tokens else [None] * n
        for i in range(n):
            rec = RequestRecord(index=i, level=level, repeat=repeat, warmup=warmup, prefix_group=groups[i],
                                target_prompt_tokens=lengths[i] if self.exact else None, max_tokens=outputs[i])
            prompt = await self.prompt(lengths[i], groups[i], seed * 7919 + i)
            out.requests.append((self.request(prompt, rec), rec))
        return out

    def request(self, prompt: Prompt, rec: RequestRecord) -> Request:
        return self.backend.request(prompt, rec.max_tokens, self.s.api, cache=self.cache)

    async def _trace_level(self, level: float, repeat: int) -> LevelWork:
        s, out = self.s, LevelWork()
        assert self.pool is not None
        for i, row in enumerate(self.rows):
            rec = RequestRecord(index=i, level=level, repeat=repeat, source_line=row.line,
                                target_prompt_tokens=row.input_length, max_tokens=row.output_length)
            ids = workload.trace_prompt(row, self.pool, s.trace_block_tokens, s.seed, i)
            out.requests.append((self.request(ids, rec), rec))
        out.offsets_s = workload.trace_offsets(self.rows, s.time_scale)
        return out

    # ---- prompts
    async def prompt(self, length: int, group: Optional[int], seed: int) -> Prompt:
        """A prompt of `length` tokens: group's shared prefix (if any), then a part of its own."""
        s = self.s
        prefix = None if group is None else await self._prefix(group)
        if self.pool is not None:
            rest = prompts.token_prompts(self.pool, 1, length - (s.prefix_tokens if prefix else 0), seed)[0]
            return (prefix or []) + rest
        lead = f"{prefix} " if prefix else ""
        if self.exact:
            async def count(session: aiohttp.ClientSession, text: str) -> int:
                return await self.backend.chat_prompt_tokens(session, lead + text)

            text = await prompts.exact_text(count, length, random.Random(seed), self.session)
            if text is None:
                raise RuntimeError(f"could not build a chat prompt of exactly {length} tokens")
            return lead + text
        return lead + prompts.estimated_text(1, max(1, length - (s.prefix_tokens if prefix else 0)), seed)[0]

    async def _prefix(self, group: int) -> Prompt:
        if group not in self._prefixes:
            s = self.s
            if self.pool is not None:
                self._prefixes[group] = workload.prefix_tokens_of(self.pool, group, s.prefix_tokens, s.seed)
            elif self.exact:
                async def count(session: aiohttp.ClientSession, text: str) -> int:
                    return len(await self.backend.tokenize(session, text))

                rng = random.Random(f"prefix:{s.seed}:{group}")
                self._prefixes[group] = await prompts.exact_text(count, s.prefix_tokens, rng, self.session) or ""
            else:
                self._prefixes[group] = prompts.estimated_text(1, s.prefix_tokens, s.seed * 31 + group)[0]
        return self._prefixes[group]

    async def user_message(self, length: int, seed: int) -> Prompt:
        """A new user message of `length` tokens (token ids, or text) for a conversation's turn."""
        if self.pool is not None:
            return prompts.token_prompts(self.pool, 1, length, seed)[0]
        return await self.prompt(length, None, seed)

    # ---- datasets
    def _entry_prompt(self, messages: tuple[workload.Message, ...]) -> Prompt:
        if self.s.api == "chat":
            return [{"role": m.role, "content": m.content} for m in messages]
        return "\n\n".join(m.content for m in messages)

    async def prompt_length(self, prompt: Prompt) -> int:
        """The server's count of a dataset prompt (an estimate where it has no tokenizer)."""
        if not self.exact:
            text = prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in prompt)
            return max(1, round(len(text) / prompts.CHARS_PER_TOKEN))
        if isinstance(prompt, str):
            return len(await self.backend.tokenize(self.session, prompt))
        return await self.backend.chat_prompt_tokens(self.session, prompt)

    async def _load_dataset(self) -> None:
        s = self.s
        entries = workload.load_dataset(workload.resolve_path(s.dataset or ""))
        self.entries = [e for e in entries
                        if await self.prompt_length(self._entry_prompt(e.messages)) <= s.prompt_tokens]
        self.left_out = len(entries) - len(self.entries)
        if not self.entries:
            raise ConfigError(f"scenario.dataset={s.dataset}: no entry has a prompt of at most "
                              f"scenario.prompt_tokens={s.prompt_tokens} tokens")

    async def _entry_output(self, entry: workload.Entry, seed: int, i: int) -> int:
        """Output tokens for a dataset entry: its own output_tokens, else its reply's length, else the
        scenario's output distribution; at most scenario.max_tokens."""
        s = self.s
        n = entry.output_tokens
        if n is None and entry.reply:
            n = await self.prompt_length(entry.reply)
        if n is None:
            n = workload.sample_lengths(s.output_dist, s.max_tokens, 1, seed * 7919 + i)[0]
        return max(1, min(n, s.max_tokens))


class Conversation:
    """One multi-turn conversation (loadgen.Conversation): every turn sends the whole history (the
    earlier prompts and the server's own answers) and a new user message. With token ids the history
    is the earlier turn's prompt ids plus the server's tokens for its answer, so the server can serve
    the history from its cache; with the chat API it is the messages so far."""

    def __init__(self, traffic: Traffic, index: int, level: float, repeat: int, seed: int):
        s = traffic.s
        self.traffic, self.index, self.level, self.repeat = traffic, index, level, repeat
        self.seed = seed * 104_729 + index
        rng = random.Random(self.seed)
        self.entry = traffic.entries[index % len(traffic.entries)] if traffic.entries else None
        turns = s.conversation.turns
        if self.entry is not None:
            turns = min(turns, len(self.entry.user_turns))
        self.turns = turns
        mean = s.conversation.think_time_s
        self.think_s = [0.0] + [rng.expovariate(1 / mean) if mean > 0 else 0.0 for _ in range(turns - 1)]
        self.lengths = workload.sample_lengths(s.prompt_dist, s.prompt_tokens, turns, self.seed)
        self.outputs = workload.sample_lengths(s.output_dist, s.max_tokens, turns, self.seed + 1)
        self.group = workload.prefix_groups_of(1, s.prefix_groups, self.seed)[0] if s.prefix_tokens else None
        self.history: Any = None  # token ids, a text or messages

    async def turn(self, t: int, previous: Optional[RequestRecord]) -> tuple[Request, RequestRecord]:
        tr, s = self.traffic, self.traffic.s
        if previous is not None:
            self.history = await self._with_answer(self.history, "".join(previous.text or []))
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
                            max_tokens=self.outputs[t], text=[] if t + 1 < self.turns else None,
                            source_line=self.entry.line if self.entry else None)
        return tr.request(prompt, rec), rec

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
