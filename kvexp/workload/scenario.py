"""The workload's shape, read from a scenario: what it sends (kind), whether the server's prompt cache
is part of what is measured, what one sequence must fit and what the planner plans with (longest and
mean lengths), and check_scenario, which refuses a workload setting in one line naming the key. Pure
but for reading a dataset or trace file (cached)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from kvexp.core.config import MAX_TOKENS, DistKind, ScenarioConfig
from kvexp.workload.dataset import load_dataset
from kvexp.workload.files import DataError, resolve_path
from kvexp.workload.lengths import bounds, check_dist, expected_mean
from kvexp.workload.trace import load_trace, trace_offsets, trace_rows
from kvexp.workload.values import require

MAX_GROUPS = 65_536  # shared prefixes of a scenario
MAX_TURNS = 1000  # turns of a conversation
MAX_TIME_SCALE = 1000.0  # a trace slowed down more than this is a typo
MAX_TRACE_SPAN_S = 7 * 24 * 3600  # a replay longer than a week (scaled) is a typo


def kind(s: ScenarioConfig) -> str:
    """What a scenario sends: trace, dataset, conversation, shared prefix or synthetic."""
    if s.trace:
        return "trace"
    if s.dataset:
        return "dataset"
    if s.conversation.turns > 1:
        return "conversation"
    return "shared prefix" if s.prefix_tokens else "synthetic"


def reuses_cache(s: ScenarioConfig) -> bool:
    """The workload sends prompts that share a beginning on purpose (prefixes, conversation history,
    a trace's block hashes, a dataset's system prompts): the server's prompt cache is part of what is
    measured."""
    return kind(s) != "synthetic"


def resets_cache(s: ScenarioConfig) -> bool:
    """The server's prefix cache is reset before each level (scenario.reset_cache, reuse workloads)."""
    return s.reset_cache and reuses_cache(s)


def longest_request(s: ScenarioConfig) -> tuple[int, int]:
    """(prompt, output) tokens of the scenario's longest request: what one sequence's context must fit.
    A conversation's last turn sends every turn before it (prompts and answers) as its prompt; a
    dataset's prompts are at most prompt_tokens (longer ones are left out)."""
    if s.trace:
        row = max(trace_rows(s), key=lambda r: r.input_length + r.output_length)
        return row.input_length, row.output_length
    prompt = s.prompt_tokens if s.dataset else bounds(s.prompt_dist, s.prompt_tokens)[1]
    output = s.max_tokens if s.dataset else bounds(s.output_dist, s.max_tokens)[1]
    turns = s.conversation.turns
    return turns * prompt + (turns - 1) * output, output


def longest_sequence(s: ScenarioConfig) -> int:
    """Tokens the longest request of the scenario may hold, prompt and output."""
    return sum(longest_request(s))


def mean_lengths(s: ScenarioConfig) -> tuple[float, float]:
    """(mean prompt tokens, mean output tokens) of a request: what the planner's KV usage is made of.
    A conversation's turn t (from 0) sends t earlier turns as history; a dataset counts at its caps."""
    if s.trace:
        rows = trace_rows(s)
        return (sum(r.input_length for r in rows) / len(rows), sum(r.output_length for r in rows) / len(rows))
    if s.dataset:
        prompt, output = float(s.prompt_tokens), float(s.max_tokens)
    else:
        prompt, output = expected_mean(s.prompt_dist, s.prompt_tokens), expected_mean(s.output_dist, s.max_tokens)
    turns = s.conversation.turns
    return prompt + (turns - 1) / 2 * (prompt + output), output


def check_scenario(s: ScenarioConfig) -> None:
    """The workload's settings, each refused in one line naming the key (files: the line and field)."""
    check_dist(s.prompt_dist, s.prompt_tokens, "scenario.prompt_dist")
    check_dist(s.output_dist, s.max_tokens, "scenario.output_dist")
    require(0 <= s.prefix_tokens <= MAX_TOKENS, f"scenario.prefix_tokens={s.prefix_tokens}: must be in 0..{MAX_TOKENS:,}")
    require(1 <= s.prefix_groups <= MAX_GROUPS, f"scenario.prefix_groups={s.prefix_groups}: must be in 1..{MAX_GROUPS:,}")
    shortest = bounds(s.prompt_dist, s.prompt_tokens)[0]
    require(s.prefix_tokens < shortest or not s.prefix_tokens or s.dataset or s.trace,
            f"scenario.prefix_tokens={s.prefix_tokens}: must be shorter than the shortest prompt ({shortest} tokens), "
            "which holds the prefix and a part of its own")
    c = s.conversation
    require(1 <= c.turns <= MAX_TURNS, f"scenario.conversation.turns={c.turns}: must be in 1..{MAX_TURNS}")
    require(0 <= c.think_time_s <= 3600, f"scenario.conversation.think_time_s={c.think_time_s}: must be in 0..3600 s")
    if c.turns > 1:
        require(not s.rates and s.search != "rate" and not s.max_start_rate and not s.max_concurrency,
                "scenario.conversation.turns > 1: conversations run closed loop (a level's concurrency is the "
                "conversations in flight); leave scenario.rates, max_concurrency and max_start_rate unset")
    require(not s.prefix_tokens or s.prefix_groups <= s.requests,
            f"scenario.prefix_groups={s.prefix_groups}: more groups than the {s.requests} requests (or "
            "conversations) of a level, so no prefix would be shared; lower it")
    require(not (s.dataset and s.trace), "scenario.dataset and scenario.trace are both set: give one")
    if s.dataset or s.trace:
        what = "scenario.dataset" if s.dataset else "scenario.trace"
        require(not s.prefix_tokens, f"{what} with scenario.prefix_tokens: the file's prompts are sent as they are; "
                "give one")
        require(s.prompt_dist.kind == DistKind.fixed, f"{what} with scenario.prompt_dist: the file's prompts have "
                "their own lengths; leave prompt_dist fixed")
    if s.trace:
        require(s.output_dist.kind == DistKind.fixed, "scenario.trace with scenario.output_dist: the trace gives "
                "each row's output length; leave output_dist fixed")
    require(not (s.trace and c.turns > 1), "scenario.trace with scenario.conversation.turns > 1: a trace's rows "
            "are single requests; give one")
    require(math.isfinite(s.time_scale) and 0 < s.time_scale <= MAX_TIME_SCALE,
            f"scenario.time_scale={s.time_scale}: must be > 0 and <= {MAX_TIME_SCALE:g} (1: the trace's own pace)")
    require(1 <= s.trace_block_tokens <= MAX_TOKENS,
            f"scenario.trace_block_tokens={s.trace_block_tokens}: must be in 1..{MAX_TOKENS:,}")
    if s.dataset:
        entries = _file_key("scenario.dataset", s.dataset, load_dataset)
        most = max((len(e.user_turns) for e in entries), default=1)
        require(c.turns <= most, f"scenario.conversation.turns={c.turns}: a dataset entry's conversation replays its "
                f"own user turns, and the longest in scenario.dataset={s.dataset} has {most}; allowed: 1..{most} "
                "with this dataset")
    if s.trace:
        require(not s.concurrency and not s.rates and not s.search,
                "scenario.trace: a trace is its own schedule; leave scenario.concurrency and scenario.rates empty "
                "(concurrency=[]) and scale it with scenario.time_scale")
        rows = _file_key("scenario.trace", s.trace, lambda path: load_trace(path)[:s.requests])
        span = trace_offsets(rows, s.time_scale)[-1]
        require(span > 0, f"scenario.trace={s.trace}: its first {len(rows)} row(s) have one timestamp: a trace is "
                "replayed on its arrival times, so it needs two different ones")
        require(span <= MAX_TRACE_SPAN_S, f"scenario.trace={s.trace}: its {len(rows)} rows span {span:,.0f} s at "
                f"time_scale={s.time_scale:g}, over {MAX_TRACE_SPAN_S // 3600} hours: lower scenario.time_scale or "
                "scenario.requests")


def _file_key(key: str, name: str, load: Callable[[Path], Any]) -> Any:
    """load(the file `name` stands for), its errors starting with the key that named the file."""
    try:
        return load(resolve_path(name))
    except DataError as e:
        raise DataError(f"{key}: {e}") from None
