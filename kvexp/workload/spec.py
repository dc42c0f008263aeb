"""What a level sends: the pure part of the user's traffic.

- Length distributions of prompts and outputs around a scenario's own figure (the centre):
  check_dist, sample_lengths, bounds, expected_mean, and summary / histogram of realised lengths.
- Shared prefixes: which of `prefix_groups` prefixes each request starts with, and the prefix's ids.
- Datasets: JSONL of chat messages ({"messages": [...]}), ShareGPT ({"conversations": [...]}) or
  plain prompts ({"prompt": "..."}), read into Entry objects; "@name" is a file kvexp ships.
- Traces: Mooncake's JSONL (timestamp ms, input_length, output_length, hash_ids), read into TraceRow
  objects, with the prompt of a row built from one seeded block of token ids per hash id, so rows
  that share hash ids share a prompt prefix.
- write_examples: the small example files kvexp ships in kvexp/datasets/ (`python -m kvexp.workload.spec
  examples [DIR]` writes them again). kvexp never downloads a dataset.

Everything here is seeded and deterministic; nothing talks to a server."""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any, Callable, Optional, Sequence

from kvexp.core.config import MAX_TOKENS, ConfigError, DistKind, LengthDist, ScenarioConfig

DATASETS_DIR = Path(__file__).parent / "datasets"
EXPECTED_MEAN_SAMPLES = 20000  # samples behind the mean of a clipped normal or lognormal
MAX_GROUPS = 65_536  # shared prefixes of a scenario
MAX_TURNS = 1000  # turns of a conversation
MAX_TIME_SCALE = 1000.0  # a trace slowed down more than this is a typo
MAX_TRACE_SPAN_S = 7 * 24 * 3600  # a replay longer than a week (scaled) is a typo


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _fmt(x: float) -> str:
    """A number as a person wrote it: 120, 120.5 (never 1.2e+02)."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


# ---------------------------------------------------------------------------------------------------
# Length distributions


def _kind(d: LengthDist, key: str) -> DistKind:
    try:
        return DistKind(d.kind)
    except ValueError:
        raise ConfigError(f"{key}.kind={d.kind!r}: allowed values are {', '.join(k.value for k in DistKind)}") from None


# the fields each kind reads (a field given to a kind that does not read it is refused, not ignored)
DIST_FIELDS = {DistKind.fixed: (), DistKind.uniform: ("min", "max"), DistKind.normal: ("min", "max", "std"),
               DistKind.lognormal: ("min", "max", "sigma"), DistKind.histogram: ("bins", "weights")}


def check_dist(d: LengthDist, centre: int, key: str) -> None:
    """Refuse a distribution that cannot be sampled, with one line starting with `key`."""
    kind = _kind(d, key)
    for name in ("min", "max", "std", "sigma", "bins", "weights"):
        given = getattr(d, name) not in (None, [])
        _require(not given or name in DIST_FIELDS[kind],
                 f"{key}.{name}: kind={kind} does not use it (it reads {', '.join(DIST_FIELDS[kind]) or 'nothing'})")
    if kind == DistKind.fixed:
        return
    if kind == DistKind.histogram:
        bins, weights = list(d.bins), list(d.weights)
        _require(bool(bins), f"{key}: kind=histogram needs bins (the lengths) and weights")
        _require(len(bins) == len(weights),
                 f"{key}: kind=histogram needs as many weights as bins, got {len(bins)} bins and {len(weights)} weights")
        _require(all(_is_int(b) and 1 <= b <= MAX_TOKENS for b in bins),
                 f"{key}.bins={bins}: every bin must be an integer in 1..{MAX_TOKENS:,}")
        _require(all(_is_num(w) and w >= 0 for w in weights) and sum(weights) > 0,
                 f"{key}.weights={weights}: every weight must be >= 0 and their sum > 0")
        return
    _require(d.min is not None and d.max is not None, f"{key}: kind={kind} needs min and max")
    for name in ("min", "max"):
        v = getattr(d, name)
        _require(_is_int(v) and 1 <= v <= MAX_TOKENS, f"{key}.{name}={v!r}: must be an integer in 1..{MAX_TOKENS:,}")
    if kind == DistKind.uniform:
        _require(d.min <= d.max, f"{key}: kind=uniform needs 1 <= min <= max, got min={d.min}, max={d.max}")
        return
    spread = "std" if kind == DistKind.normal else "sigma"
    v = getattr(d, spread)
    _require(_is_num(v) and v > 0, f"{key}: kind={kind} needs {spread} > 0, got {spread}={v}")
    _require(d.min <= centre <= d.max,
             f"{key}: kind={kind} needs 1 <= min <= centre <= max, got min={d.min}, centre={centre}, max={d.max}")


def sample_lengths(d: LengthDist, centre: int, n: int, seed: int) -> list[int]:
    """n lengths drawn from `d` around `centre` with random.Random(seed); the same seed, the same list."""
    check_dist(d, centre, "length distribution")
    kind, rng = DistKind(d.kind), random.Random(seed)
    if kind == DistKind.fixed:
        return [centre] * n
    if kind == DistKind.uniform:
        return [rng.randint(d.min, d.max) for _ in range(n)]
    if kind == DistKind.histogram:
        return rng.choices(list(d.bins), weights=list(d.weights), k=n)
    lo, hi = d.min, d.max
    if kind == DistKind.normal:
        return [min(hi, max(lo, round(rng.gauss(centre, d.std)))) for _ in range(n)]
    # lognormal: the exponent is capped (exp(50) x centre is far above any max) so it cannot overflow
    return [min(hi, max(lo, round(centre * math.exp(min(50.0, rng.gauss(0.0, d.sigma)))))) for _ in range(n)]


def bounds(d: LengthDist, centre: int) -> tuple[int, int]:
    """Smallest and largest length `d` can give (a histogram's bins of weight 0 are never drawn)."""
    check_dist(d, centre, "length distribution")
    kind = DistKind(d.kind)
    if kind == DistKind.fixed:
        return centre, centre
    if kind == DistKind.histogram:
        drawn = [b for b, w in zip(d.bins, d.weights) if w > 0]
        return min(drawn), max(drawn)
    return d.min, d.max


def expected_mean(d: LengthDist, centre: int) -> float:
    """Mean length of `d`: exact for fixed, uniform and histogram; for normal and lognormal (clipped)
    the mean of EXPECTED_MEAN_SAMPLES samples with seed 0."""
    check_dist(d, centre, "length distribution")
    kind = DistKind(d.kind)
    if kind == DistKind.fixed:
        return float(centre)
    if kind == DistKind.uniform:
        return (d.min + d.max) / 2
    if kind == DistKind.histogram:
        return sum(b * w for b, w in zip(d.bins, d.weights)) / sum(d.weights)
    return fmean(sample_lengths(d, centre, EXPECTED_MEAN_SAMPLES, seed=0))


# ---------------------------------------------------------------------------------------------------
# Shared prefixes


def prefix_groups_of(n: int, groups: int, seed: int) -> list[int]:
    """The prefix group (0..groups-1) of each of n requests: every group n//groups or n//groups+1
    of them, in a seeded shuffled order."""
    if groups < 1:
        raise ValueError(f"groups={groups}: must be >= 1")
    order = [i % groups for i in range(n)]
    random.Random(f"prefix-groups:{seed}").shuffle(order)
    return order


def prefix_tokens_of(pool: list[int], group: int, length: int, seed: int) -> list[int]:
    """The shared prefix of a group: `length` token ids from `pool`, the same for every request of it."""
    if not pool and length > 0:
        raise ValueError("the token pool is empty")
    return random.Random(f"prefix:{seed}:{group}").choices(pool, k=length)


# ---------------------------------------------------------------------------------------------------
# Reading JSONL files


class DataError(ConfigError):
    """A dataset or trace file that cannot be used; the message is one line naming the file, the
    line and the field."""


class _Bad(Exception):
    """A problem with one line, turned into a DataError naming the file and line."""


_CACHE: dict[tuple, list] = {}
_CACHE_SIZE = 8


def _type(v: Any) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "bool", int: "int", float: "float"}
    return "null" if v is None else names.get(type(v), type(v).__name__)


def _short(v: Any, limit: int = 40) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _records(path: str | Path, parse: Callable[[int, Any], Any]) -> list:
    """parse(line_number, json_value) of every non-blank line of a UTF-8 JSONL file, cached on the
    file's resolved path, modification time and size."""
    shown = str(path)
    p = Path(path).expanduser()
    try:
        st = p.stat()
        key = (str(p.resolve()), st.st_mtime_ns, st.st_size, parse)
    except OSError as e:
        raise DataError(f"{shown}: cannot read: {e.strerror or e}") from None
    if key in _CACHE:
        return list(_CACHE[key])
    out = []
    try:
        with p.open("rb") as f:
            for n, raw in enumerate(f, start=1):
                try:
                    text = raw.decode("utf-8-sig" if n == 1 else "utf-8")
                except UnicodeDecodeError:
                    raise DataError(f"{shown} line {n}: not UTF-8") from None
                if not text.strip():
                    continue
                if not out and text.lstrip().startswith("["):  # ShareGPT's files are one JSON array
                    raise DataError(f"{shown} line {n}: a JSON array: kvexp reads JSONL, one object per line "
                                    f"(convert with `jq -c '.[]' {shown}`)")
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as e:
                    raise DataError(f"{shown} line {n}: not JSON ({e.msg} at column {e.colno})") from None
                except RecursionError:
                    raise DataError(f"{shown} line {n}: not JSON (nested too deeply)") from None
                try:
                    out.append(parse(n, value))
                except _Bad as e:
                    raise DataError(f"{shown} line {n}: {e}") from None
    except OSError as e:
        raise DataError(f"{shown}: cannot read: {e.strerror or e}") from None
    if not out:
        raise DataError(f"{shown}: no entries")
    while len(_CACHE) >= _CACHE_SIZE:
        del _CACHE[next(iter(_CACHE))]
    _CACHE[key] = out
    return list(out)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise _Bad(msg)


def resolve_path(name: str) -> Path:
    """"@name" (or "@name" without .jsonl) is a file kvexp ships in kvexp/datasets/; anything else is
    a path (~ expanded)."""
    if not name.startswith("@"):
        return Path(name).expanduser()
    shipped = shipped_names()
    for cand in (name[1:], name[1:] + ".jsonl"):
        if cand in shipped:
            return DATASETS_DIR / cand
    raise DataError(f"{name}: kvexp ships no such file (shipped: {', '.join('@' + s for s in shipped) or 'none'})")


def shipped_names() -> list[str]:
    """Names of the files in kvexp/datasets/."""
    return sorted(p.name for p in DATASETS_DIR.glob("*.jsonl")) if DATASETS_DIR.is_dir() else []


def _path(path: str | Path) -> str | Path:
    return resolve_path(path) if isinstance(path, str) and path.startswith("@") else path


# ---------------------------------------------------------------------------------------------------
# Datasets


@dataclass(frozen=True)
class Message:
    role: str  # system | user | assistant
    content: str


@dataclass(frozen=True)
class Entry:
    """One dataset line: the conversation up to and including its last user message (what a single
    request sends), the assistant's reply after it if the file has one, the output length the line
    asks for if any, and every user message in order (for multi-turn replay)."""

    line: int
    messages: tuple[Message, ...]
    reply: Optional[str]
    output_tokens: Optional[int]
    user_turns: tuple[str, ...]


CHAT_ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
_SHAPES = ("messages", "conversations", "prompt")


def _turns(value: Any, field: str, role_key: str, text_key: str, roles: dict[str, str]) -> list[Message]:
    _check(isinstance(value, list), f"{field}: expected a list, got {_type(value)}")
    out = []
    for i, m in enumerate(value):
        at = f"{field}[{i}]"
        _check(isinstance(m, dict), f"{at}: expected an object, got {_type(m)}")
        _check(role_key in m, f"{at}.{role_key}: missing")
        role = m[role_key]
        _check(isinstance(role, str) and role in roles,
               f"{at}.{role_key}: {_short(role)} is not one of {', '.join(roles)}")
        _check(text_key in m, f"{at}.{text_key}: missing")
        _check(isinstance(m[text_key], str), f"{at}.{text_key}: expected a string, got {_type(m[text_key])}")
        out.append(Message(roles[role], m[text_key]))
    return out


def _entry(n: int, obj: Any) -> Entry:
    _check(isinstance(obj, dict) and any(k in obj for k in _SHAPES),
           'expected an object with "messages", "conversations" or "prompt"')
    given = [k for k in _SHAPES if k in obj]
    _check(len(given) == 1, f'has both "{given[0]}" and "{given[-1]}": give one')
    if "messages" in obj:
        turns = _turns(obj["messages"], "messages", "role", "content", {r: r for r in CHAT_ROLES})
    elif "conversations" in obj:
        turns = _turns(obj["conversations"], "conversations", "from", "value", SHAREGPT_ROLES)
    else:
        _check(isinstance(obj["prompt"], str), f"prompt: expected a string, got {_type(obj['prompt'])}")
        turns = [Message("user", obj["prompt"])]
    users = [i for i, m in enumerate(turns) if m.role == "user"]
    _check(bool(users), "no user message")
    out_tokens = obj.get("output_tokens")
    _check(out_tokens is None or (_is_int(out_tokens) and out_tokens >= 1),
           "output_tokens: must be an integer >= 1")
    _check(out_tokens is None or out_tokens <= MAX_TOKENS, f"output_tokens: must be <= {MAX_TOKENS:,}")
    last = users[-1]
    reply = next((m.content for m in turns[last + 1:] if m.role == "assistant"), None)
    return Entry(line=n, messages=tuple(turns[: last + 1]), reply=reply, output_tokens=out_tokens,
                 user_turns=tuple(turns[i].content for i in users))


def load_dataset(path: str | Path) -> list[Entry]:
    """Every entry of a JSONL dataset, in file order. Raises DataError naming the file, line and field."""
    return _records(_path(path), _entry)


# ---------------------------------------------------------------------------------------------------
# Traces


@dataclass(frozen=True)
class TraceRow:
    line: int
    timestamp_s: float  # seconds since the trace's start (the file gives milliseconds)
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


TRACE_FIELDS = ("timestamp", "input_length", "output_length")


def _trace_row(n: int, obj: Any) -> TraceRow:
    _check(isinstance(obj, dict), f"expected an object with {', '.join(TRACE_FIELDS)}, got {_type(obj)}")
    for k in TRACE_FIELDS:
        _check(k in obj, f"{k}: missing (each line needs {', '.join(TRACE_FIELDS)})")
    ts = obj["timestamp"]
    _check(_is_num(ts) and ts >= 0, f"timestamp: {_short(ts)} must be a finite number >= 0 (milliseconds)")
    for k in ("input_length", "output_length"):
        v = obj[k]
        _check(_is_int(v) and 1 <= v <= MAX_TOKENS, f"{k}: {_short(v)} must be an integer in 1..{MAX_TOKENS:,}")
    ids = obj.get("hash_ids")
    ids = [] if ids is None else ids
    _check(isinstance(ids, list), f"hash_ids: expected a list of integers >= 0, got {_type(ids)}")
    for i, h in enumerate(ids):
        _check(_is_int(h) and h >= 0, f"hash_ids[{i}]: {_short(h)} must be an integer >= 0")
    return TraceRow(line=n, timestamp_s=ts / 1000.0, input_length=obj["input_length"],
                    output_length=obj["output_length"], hash_ids=tuple(ids))


def load_trace(path: str | Path) -> list[TraceRow]:
    """Every row of a Mooncake JSONL trace, in file order, timestamps non-decreasing. Raises DataError
    naming the file, line and field."""
    path = _path(path)
    shown = str(path)
    rows = _records(path, _trace_row)
    for prev, row in zip(rows, rows[1:]):
        if row.timestamp_s < prev.timestamp_s:
            raise DataError(f"{shown} line {row.line}: timestamp: {_fmt(row.timestamp_s * 1000)} is before "
                            f"the previous line's {_fmt(prev.timestamp_s * 1000)}")
    return rows


def trace_offsets(rows: Sequence[TraceRow], time_scale: float) -> list[float]:
    """When each row is sent, in seconds after the first, stretched by time_scale."""
    if not rows:
        return []
    t0 = rows[0].timestamp_s
    return [(r.timestamp_s - t0) * time_scale for r in rows]


def trace_prompt(row: TraceRow, pool: list[int], block_tokens: int, seed: int, index: int) -> list[int]:
    """Exactly row.input_length token ids: one seeded block of block_tokens ids per hash id (equal
    hash ids give equal blocks, so rows sharing leading hash ids share a prefix), cut to length; what
    the blocks leave short is filled with ids of this row alone (seeded by index)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens={block_tokens}: must be >= 1")
    if not pool:
        raise ValueError("the token pool is empty")
    out: list[int] = []
    for h in row.hash_ids:
        if len(out) >= row.input_length:
            break
        out.extend(random.Random(f"block:{seed}:{h}").choices(pool, k=block_tokens))
    del out[row.input_length:]
    out.extend(random.Random(f"tail:{seed}:{index}").choices(pool, k=row.input_length - len(out)))
    return out


# ---------------------------------------------------------------------------------------------------
# Example files kvexp ships


EXAMPLES_SEED = 1729

# ---------------------------------------------------------------------------------------------------
# The workload's shape: what the server must be sized for and what the planner plans with. Pure but
# for reading a trace file (cached).

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


def trace_rows(s: ScenarioConfig) -> list[TraceRow]:
    """The rows a trace scenario replays: the first scenario.requests of its file."""
    return load_trace(resolve_path(s.trace or ""))[:s.requests]


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


def trace_rate(s: ScenarioConfig) -> float:
    """A trace's mean arrival rate at its time scale (requests/s): the value of its one level."""
    offsets = trace_offsets(trace_rows(s), s.time_scale)
    return float(f"{(len(offsets) - 1) / offsets[-1]:.4g}")  # check_scenario: the span is > 0


def dist_json(d: LengthDist, centre: int) -> dict[str, Any]:
    """A length distribution as the result records it (with its mean)."""
    out: dict[str, Any] = {"kind": str(d.kind), "centre": centre}
    for key in DIST_FIELDS[DistKind(d.kind)]:
        value = getattr(d, key)
        out[key] = list(value) if isinstance(value, list) else value
    out["mean"] = round(expected_mean(d, centre), 3)
    return out


def check_scenario(s: ScenarioConfig) -> None:
    """The workload's settings, each refused in one line naming the key (files: the line and field)."""
    check_dist(s.prompt_dist, s.prompt_tokens, "scenario.prompt_dist")
    check_dist(s.output_dist, s.max_tokens, "scenario.output_dist")
    _require(0 <= s.prefix_tokens <= MAX_TOKENS, f"scenario.prefix_tokens={s.prefix_tokens}: must be in 0..{MAX_TOKENS:,}")
    _require(1 <= s.prefix_groups <= MAX_GROUPS, f"scenario.prefix_groups={s.prefix_groups}: must be in 1..{MAX_GROUPS:,}")
    shortest = bounds(s.prompt_dist, s.prompt_tokens)[0]
    _require(s.prefix_tokens < shortest or not s.prefix_tokens or s.dataset or s.trace,
             f"scenario.prefix_tokens={s.prefix_tokens}: must be shorter than the shortest prompt ({shortest} tokens), "
             "which holds the prefix and a part of its own")
    c = s.conversation
    _require(1 <= c.turns <= MAX_TURNS, f"scenario.conversation.turns={c.turns}: must be in 1..{MAX_TURNS}")
    _require(0 <= c.think_time_s <= 3600, f"scenario.conversation.think_time_s={c.think_time_s}: must be in 0..3600 s")
    if c.turns > 1:
        _require(not s.rates and s.search != "rate" and not s.max_start_rate and not s.max_concurrency,
                 "scenario.conversation.turns > 1: conversations run closed loop (a level's concurrency is the "
                 "conversations in flight); leave scenario.rates, max_concurrency and max_start_rate unset")
    _require(not s.prefix_tokens or s.prefix_groups <= s.requests,
             f"scenario.prefix_groups={s.prefix_groups}: more groups than the {s.requests} requests (or "
             "conversations) of a level, so no prefix would be shared; lower it")
    _require(not (s.dataset and s.trace), "scenario.dataset and scenario.trace are both set: give one")
    if s.dataset or s.trace:
        what = "scenario.dataset" if s.dataset else "scenario.trace"
        _require(not s.prefix_tokens, f"{what} with scenario.prefix_tokens: the file's prompts are sent as they are; "
                 "give one")
        _require(s.prompt_dist.kind == DistKind.fixed, f"{what} with scenario.prompt_dist: the file's prompts have "
                 "their own lengths; leave prompt_dist fixed")
    if s.trace:
        _require(s.output_dist.kind == DistKind.fixed, "scenario.trace with scenario.output_dist: the trace gives "
                 "each row's output length; leave output_dist fixed")
    _require(not (s.trace and c.turns > 1), "scenario.trace with scenario.conversation.turns > 1: a trace's rows "
             "are single requests; give one")
    _require(math.isfinite(s.time_scale) and 0 < s.time_scale <= MAX_TIME_SCALE,
             f"scenario.time_scale={s.time_scale}: must be > 0 and <= {MAX_TIME_SCALE:g} (1: the trace's own pace)")
    _require(1 <= s.trace_block_tokens <= MAX_TOKENS,
             f"scenario.trace_block_tokens={s.trace_block_tokens}: must be in 1..{MAX_TOKENS:,}")
    if s.dataset:
        _file_key("scenario.dataset", s.dataset, load_dataset)
    if s.trace:
        _require(not s.concurrency and not s.rates and not s.search,
                 "scenario.trace: a trace is its own schedule; leave scenario.concurrency and scenario.rates empty "
                 "(concurrency=[]) and scale it with scenario.time_scale")
        rows = _file_key("scenario.trace", s.trace, lambda path: load_trace(path)[:s.requests])
        span = trace_offsets(rows, s.time_scale)[-1]
        _require(span > 0, f"scenario.trace={s.trace}: its first {len(rows)} row(s) have one timestamp: a trace is "
                 "replayed on its arrival times, so it needs two different ones")
        _require(span <= MAX_TRACE_SPAN_S, f"scenario.trace={s.trace}: its {len(rows)} rows span {span:,.0f} s at "
                 f"time_scale={s.time_scale:g}, over {MAX_TRACE_SPAN_S // 3600} hours: lower scenario.time_scale or "
                 "scenario.requests")


def _file_key(key: str, name: str, load: Callable[[Path], Any]) -> Any:
    """load(the file `name` stands for), its errors starting with the key that named the file."""
    try:
        return load(resolve_path(name))
    except DataError as e:
        raise DataError(f"{key}: {e}") from None




def words(rng: random.Random, n: int) -> list[str]:
    """n made-up lowercase words of 2 to 8 letters (prompts and example files)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(n)]


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(words(rng, rng.randint(lo, hi)))


def _example_chat(rng: random.Random) -> list[tuple[str, str]]:
    """(role, text) of one made-up conversation: maybe a system turn, then 1-3 user/assistant exchanges."""
    turns = [("system", _text(rng, 5, 15))] if rng.random() < 0.3 else []
    for _ in range(rng.randint(1, 3)):
        turns += [("user", _text(rng, 5, 60)), ("assistant", _text(rng, 5, 40))]
    return turns


def _example_trace(rng: random.Random, rows: int = 64, rate: float = 8.0, block: int = 16) -> list[dict]:
    groups = [list(range(g * 4, g * 4 + rng.randint(2, 4))) for g in range(4)]  # "system prompt" ids
    fresh, t, out = 1000, 0.0, []
    for i in range(rows):
        if i:
            t += rng.expovariate(rate)
        length = rng.randint(48, 192)
        ids = list(rng.choice(groups)) if rng.random() < 0.5 else []
        ids = ids[: math.ceil(length / block)]
        while len(ids) < math.ceil(length / block):
            ids.append(fresh)
            fresh += 1
        out.append({"timestamp": round(t * 1000), "input_length": length,
                    "output_length": rng.randint(8, 32), "hash_ids": ids})
    return out


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows), encoding="utf-8")
    return path


def write_examples(directory: Path) -> list[Path]:
    """Write sharegpt-tiny.jsonl, chat-tiny.jsonl and trace-tiny.jsonl (made-up words, fixed seed;
    the trace's hash ids are for 16-token blocks) into `directory`, and check that they load."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"examples:{EXAMPLES_SEED}:sharegpt")
    sharegpt_from = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [{"id": f"tiny-{i:03d}", "conversations": [{"from": sharegpt_from[r], "value": t}
                                                         for r, t in _example_chat(rng)]} for i in range(40)]
    rng = random.Random(f"examples:{EXAMPLES_SEED}:chat")
    chat = [{"messages": [{"role": r, "content": t} for r, t in _example_chat(rng)]} for _ in range(24)]
    trace = _example_trace(random.Random(f"examples:{EXAMPLES_SEED}:trace"))
    paths = [_write_jsonl(directory / "sharegpt-tiny.jsonl", sharegpt),
             _write_jsonl(directory / "chat-tiny.jsonl", chat),
             _write_jsonl(directory / "trace-tiny.jsonl", trace)]
    load_dataset(paths[0])
    load_dataset(paths[1])
    load_trace(paths[2])
    return paths


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvexp.workload.spec", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("examples", help="write the example datasets and trace kvexp ships")
    ex.add_argument("directory", nargs="?", default=str(DATASETS_DIR), help="default: kvexp/datasets/")
    args = ap.parse_args(argv)
    for p in write_examples(Path(args.directory)):
        print(f"{p} ({p.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
