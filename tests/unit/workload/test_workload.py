"""The pure part of the user's traffic: length distributions, shared prefixes, datasets, traces."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from kvexp.metrics import stats
from kvexp.workload import dataset, examples, files, lengths, prefixes, trace
from kvexp.core.config import ConfigError, LengthDist
from kvexp.workload.dataset import Entry, Message
from kvexp.workload.files import DataError
from kvexp.workload.trace import TraceRow

CENTRE = 100
DISTS = {
    "fixed": LengthDist(kind="fixed"),
    "uniform": LengthDist(kind="uniform", min=50, max=150),
    "normal": LengthDist(kind="normal", min=60, max=140, std=20.0),
    "lognormal": LengthDist(kind="lognormal", min=20, max=400, sigma=0.5),
    "histogram": LengthDist(kind="histogram", bins=[10, 100, 1000], weights=[1.0, 2.0, 1.0]),
}


# --- length distributions --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(DISTS))
def test_samples_within_bounds_and_deterministic(kind):
    d = DISTS[kind]
    lo, hi = lengths.bounds(d, CENTRE)
    xs = lengths.sample_lengths(d, CENTRE, 2000, seed=7)
    assert len(xs) == 2000
    assert all(isinstance(x, int) and lo <= x <= hi for x in xs)
    assert xs == lengths.sample_lengths(d, CENTRE, 2000, seed=7)
    if kind == "fixed":
        assert xs == [CENTRE] * 2000
    else:
        assert xs != lengths.sample_lengths(d, CENTRE, 2000, seed=8)


def test_bounds_per_kind():
    assert lengths.bounds(DISTS["fixed"], CENTRE) == (100, 100)
    assert lengths.bounds(DISTS["uniform"], CENTRE) == (50, 150)
    assert lengths.bounds(DISTS["normal"], CENTRE) == (60, 140)
    assert lengths.bounds(DISTS["histogram"], CENTRE) == (10, 1000)
    zero_tail = LengthDist(kind="histogram", bins=[5, 50, 500], weights=[1.0, 1.0, 0.0])
    assert lengths.bounds(zero_tail, CENTRE) == (5, 50)
    assert set(lengths.sample_lengths(zero_tail, CENTRE, 500, seed=1)) == {5, 50}


def test_normal_and_lognormal_are_clipped_to_min_max():
    wide = LengthDist(kind="normal", min=90, max=110, std=1000.0)
    xs = lengths.sample_lengths(wide, CENTRE, 1000, seed=3)
    assert min(xs) == 90 and max(xs) == 110
    huge = LengthDist(kind="lognormal", min=1, max=1 << 20, sigma=500.0)
    ys = lengths.sample_lengths(huge, CENTRE, 200, seed=3)
    assert min(ys) == 1 and max(ys) == 1 << 20


def test_sample_means_near_expected():
    for kind, want in (("uniform", 100.0), ("normal", 100.0), ("histogram", 302.5)):
        xs = lengths.sample_lengths(DISTS[kind], CENTRE, 20000, seed=11)
        assert sum(xs) / len(xs) == pytest.approx(want, rel=0.05), kind
    assert lengths.expected_mean(DISTS["fixed"], CENTRE) == 100.0
    assert lengths.expected_mean(DISTS["uniform"], CENTRE) == 100.0
    assert lengths.expected_mean(DISTS["histogram"], CENTRE) == pytest.approx(302.5)  # (10+200+1000)/4
    assert lengths.expected_mean(DISTS["normal"], CENTRE) == pytest.approx(100.0, abs=1.0)
    # a lognormal's median is the centre, its mean above it: exp(sigma^2/2) ~ 1.133 (a little clipped)
    assert 105 < lengths.expected_mean(DISTS["lognormal"], CENTRE) < 118


def test_lognormal_median_is_the_centre():
    xs = sorted(lengths.sample_lengths(DISTS["lognormal"], CENTRE, 20001, seed=5))
    assert xs[10000] == pytest.approx(CENTRE, rel=0.05)


BAD_DISTS = [
    (LengthDist(kind="uniform", max=10), "needs min and max"),
    (LengthDist(kind="uniform", min=20, max=10), "1 <= min <= max"),
    (LengthDist(kind="uniform", min=0, max=10), "min=0"),
    (LengthDist(kind="uniform", min=1, max=(1 << 20) + 1), "max=1048577"),
    (LengthDist(kind="normal", min=1, max=200), "std > 0"),
    (LengthDist(kind="normal", min=1, max=200, std=0.0), "std > 0"),
    (LengthDist(kind="normal", min=1, max=200, std=float("nan")), "std > 0"),
    (LengthDist(kind="normal", std=5.0), "needs min and max"),
    (LengthDist(kind="normal", min=150, max=200, std=5.0), "min <= centre <= max"),
    (LengthDist(kind="normal", min=10, max=50, std=5.0), "min <= centre <= max"),
    (LengthDist(kind="lognormal", min=1, max=200), "sigma > 0"),
    (LengthDist(kind="lognormal", min=1, max=200, sigma=-1.0), "sigma > 0"),
    (LengthDist(kind="lognormal", sigma=1.0, max=200), "needs min and max"),
    (LengthDist(kind="lognormal", min=1, max=99, sigma=1.0), "min <= centre <= max"),
    (LengthDist(kind="histogram"), "needs bins"),
    (LengthDist(kind="histogram", bins=[1, 2], weights=[1.0]), "2 bins and 1 weights"),
    (LengthDist(kind="histogram", bins=[0, 2], weights=[1.0, 1.0]), "bins=[0, 2]"),
    (LengthDist(kind="histogram", bins=[1, 2], weights=[1.0, -1.0]), "weights=[1.0, -1.0]"),
    (LengthDist(kind="histogram", bins=[1, 2], weights=[0.0, 0.0]), "sum > 0"),
    (LengthDist(kind="histogram", bins=[1, 1 << 21], weights=[1.0, 1.0]), "every bin"),
    (LengthDist(kind="zipf"), "allowed values are fixed, uniform"),
]


@pytest.mark.parametrize("d, what", BAD_DISTS)
def test_check_dist_rejects_with_the_key(d, what):
    with pytest.raises(ConfigError) as e:
        lengths.check_dist(d, CENTRE, "scenario.prompt_dist")
    msg = str(e.value)
    assert msg.startswith("scenario.prompt_dist"), msg
    assert what in msg and "\n" not in msg, msg


def test_check_dist_accepts_good_ones_and_refuses_fields_a_kind_does_not_use():
    for d in DISTS.values():
        lengths.check_dist(d, CENTRE, "scenario.output_dist")
    assert str(_raises(lambda: lengths.check_dist(LengthDist(kind="fixed", min=500), CENTRE, "k"))) == \
        "k.min: kind=fixed does not use it (it reads nothing)"
    assert str(_raises(lambda: lengths.check_dist(LengthDist(kind="uniform", min=1, max=9, std=2.0), 5, "k"))) == \
        "k.std: kind=uniform does not use it (it reads min, max)"
    assert str(_raises(lambda: lengths.check_dist(LengthDist(kind="uniform"), 5, "scenario.output_dist"))) == \
        "scenario.output_dist: kind=uniform needs min and max"


def _raises(fn):
    with pytest.raises(ConfigError) as e:
        fn()
    return e.value


def test_sampling_a_bad_dist_is_refused():
    with pytest.raises(ConfigError, match="needs min and max"):
        lengths.sample_lengths(LengthDist(kind="uniform"), CENTRE, 3, seed=0)


# --- summary and histogram -------------------------------------------------------------------------


def test_summary_values_and_edges():
    assert stats.value_summary([]) is None
    s = stats.value_summary([4, 1, 3, 2])
    assert s == {"n": 4, "mean": 2.5, "p50": 2.5, "p99": pytest.approx(3.97), "min": 1, "max": 4}
    assert stats.value_summary([10, 20, 30, 40, 50])["p99"] == pytest.approx(49.6)
    assert stats.value_summary([1, 2, 2])["mean"] == 1.667
    assert stats.value_summary([7, 7, 7]) == {"n": 3, "mean": 7, "p50": 7, "p99": 7, "min": 7, "max": 7}
    assert stats.value_summary([5]) == {"n": 1, "mean": 5, "p50": 5, "p99": 5, "min": 5, "max": 5}


def test_histogram_edges():
    assert stats.histogram([]) == []
    assert stats.histogram([5, 5, 5]) == [{"lo": 5, "hi": 5, "count": 3}]
    assert stats.histogram([1, 2, 3], bins=10) == [{"lo": 1, "hi": 1, "count": 1}, {"lo": 2, "hi": 2, "count": 1},
                                                     {"lo": 3, "hi": 3, "count": 1}]
    h = stats.histogram(list(range(1, 101)), bins=10)
    assert [(b["lo"], b["hi"], b["count"]) for b in h] == [(i * 10 + 1, i * 10 + 10, 10) for i in range(10)]
    with pytest.raises(ValueError):
        stats.histogram([1], bins=0)


def test_histogram_covers_and_counts_everything():
    xs = lengths.sample_lengths(DISTS["normal"], CENTRE, 999, seed=2)
    h = stats.histogram(xs, bins=7)
    assert 1 <= len(h) <= 7
    assert sum(b["count"] for b in h) == 999
    assert h[0]["lo"] == min(xs) and h[-1]["hi"] == max(xs)
    widths = {b["hi"] - b["lo"] for b in h[:-1]}
    assert len(widths) == 1
    assert all(a["hi"] + 1 == b["lo"] for a, b in zip(h, h[1:]))


# --- shared prefixes -------------------------------------------------------------------------------


def test_prefix_groups_balanced_shuffled_seeded():
    g = prefixes.prefix_groups_of(103, 4, seed=1)
    assert len(g) == 103
    assert sorted(g.count(i) for i in range(4)) == [25, 26, 26, 26]
    assert set(g) == {0, 1, 2, 3}
    assert g == prefixes.prefix_groups_of(103, 4, seed=1)
    assert g != prefixes.prefix_groups_of(103, 4, seed=2)
    assert g != sorted(g) and g != [i % 4 for i in range(103)]
    assert prefixes.prefix_groups_of(5, 1, seed=0) == [0] * 5
    assert prefixes.prefix_groups_of(0, 3, seed=0) == []
    with pytest.raises(ValueError):
        prefixes.prefix_groups_of(3, 0, seed=0)


def test_prefix_tokens_per_group():
    pool = list(range(1000, 1100))
    a = prefixes.prefix_tokens_of(pool, 0, 32, seed=5)
    assert len(a) == 32 and all(t in pool for t in a)
    assert a == prefixes.prefix_tokens_of(pool, 0, 32, seed=5)
    assert a != prefixes.prefix_tokens_of(pool, 1, 32, seed=5)
    assert a != prefixes.prefix_tokens_of(pool, 0, 32, seed=6)
    assert prefixes.prefix_tokens_of(pool, 0, 0, seed=5) == []


# --- datasets --------------------------------------------------------------------------------------


def write(tmp_path: Path, lines: list, name: str = "d.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines), encoding="utf-8")
    return p


CHAT = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "how are you"},
                     {"role": "assistant", "content": "fine"}]}
SHAREGPT = {"id": "x1", "conversations": [{"from": "human", "value": "q one"}, {"from": "gpt", "value": "a one"},
                                          {"from": "user", "value": "q two"}, {"from": "chatgpt", "value": "a two"}]}
PROMPT = {"prompt": "just this", "output_tokens": 12}


def test_all_three_shapes_parse(tmp_path):
    p = write(tmp_path, [CHAT, "", SHAREGPT, "   ", PROMPT])
    chat, share, prompt = dataset.load_dataset(p)
    assert chat == Entry(line=1, messages=(Message("system", "be brief"), Message("user", "hi"),
                                           Message("assistant", "hello"), Message("user", "how are you")),
                         reply="fine", output_tokens=None, user_turns=("hi", "how are you"))
    assert share.line == 3
    assert [m.role for m in share.messages] == ["user", "assistant", "user"]
    assert share.reply == "a two" and share.user_turns == ("q one", "q two")
    assert prompt == Entry(line=5, messages=(Message("user", "just this"),), reply=None, output_tokens=12,
                           user_turns=("just this",))


def test_conversation_ending_with_user_has_no_reply(tmp_path):
    line = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"}], "output_tokens": 3}
    (e,) = dataset.load_dataset(write(tmp_path, [line]))
    assert e.reply is None and e.output_tokens == 3 and e.messages[0] == Message("system", "s")


def test_shipped_files_load():
    names = files.shipped_names()
    assert names == ["chat-tiny.jsonl", "sharegpt-tiny.jsonl", "trace-tiny.jsonl"]
    share = dataset.load_dataset("@sharegpt-tiny.jsonl")
    chat = dataset.load_dataset(files.resolve_path("@chat-tiny"))
    assert len(share) == 40 and len(chat) == 24
    assert any(e.messages[0].role == "system" for e in share)
    for e in share + chat:
        assert 1 <= len(e.user_turns) <= 3
        assert all(5 <= len(t.split()) <= 60 for t in e.user_turns)
        assert e.reply is not None and 5 <= len(e.reply.split()) <= 40
    rows = trace.load_trace("@trace-tiny.jsonl")
    assert len(rows) == 64
    assert all(48 <= r.input_length <= 192 and 8 <= r.output_length <= 32 for r in rows)
    assert all(len(r.hash_ids) == math.ceil(r.input_length / 16) for r in rows)
    shared = [r for r in rows if r.hash_ids[0] < 1000]
    assert 16 <= len(shared) <= 48
    assert len({r.hash_ids[0] for r in shared}) <= 4
    for p in files.DATASETS_DIR.glob("*.jsonl"):
        assert p.stat().st_size < 40_000, p


def test_write_examples_is_deterministic(tmp_path):
    paths = examples.write_examples(tmp_path)
    assert [p.name for p in paths] == ["sharegpt-tiny.jsonl", "chat-tiny.jsonl", "trace-tiny.jsonl"]
    for p in paths:
        assert p.read_bytes() == (files.DATASETS_DIR / p.name).read_bytes(), p.name


def bad_dataset(tmp_path, bad, blank_before=True) -> str:
    lines = [CHAT, PROMPT] + ([""] if blank_before else []) + [bad, CHAT]
    with pytest.raises(DataError) as e:
        dataset.load_dataset(write(tmp_path, lines))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


BAD_LINES = [
    ("{not json", "not JSON (Expecting property name enclosed in double quotes at column 2)"),
    ([1, 2], 'expected an object with "messages", "conversations" or "prompt"'),
    ({"text": "hi"}, 'expected an object with "messages", "conversations" or "prompt"'),
    ({"prompt": "a", "messages": []}, 'has both "messages" and "prompt": give one'),
    ({"messages": "hi"}, "messages: expected a list, got string"),
    ({"messages": []}, "no user message"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "no user message"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content: expected a string, got int"),
    ({"messages": [{"role": "user"}]}, "messages[0].content: missing"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]},
     "messages[1].role: 'tool' is not one of system, user, assistant"),
    ({"messages": ["hi"]}, "messages[0]: expected an object, got string"),
    ({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}, {"from": "robot", "value": "c"}]},
     "conversations[2].from: 'robot' is not one of system, human, user, gpt, assistant, chatgpt, bing, bard"),
    ({"conversations": [{"value": "a"}]}, "conversations[0].from: missing"),
    ({"conversations": [{"from": "human", "value": None}]}, "conversations[0].value: expected a string, got null"),
    ({"prompt": 3}, "prompt: expected a string, got int"),
    ({"prompt": "a", "output_tokens": 0}, "output_tokens: must be an integer >= 1"),
    ({"prompt": "a", "output_tokens": True}, "output_tokens: must be an integer >= 1"),
    ({"prompt": "a", "output_tokens": 2.5}, "output_tokens: must be an integer >= 1"),
]


@pytest.mark.parametrize("bad, what", BAD_LINES)
def test_bad_dataset_line_names_line_and_field(tmp_path, bad, what):
    p = tmp_path / "d.jsonl"
    msg = bad_dataset(tmp_path, bad)
    assert msg == f"{p} line 4: {what}"
    msg = bad_dataset(tmp_path, bad, blank_before=False)
    assert msg == f"{p} line 3: {what}"


def test_not_utf8_names_the_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(json.dumps(CHAT).encode() + b"\n\n" + b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError) as e:
        dataset.load_dataset(p)
    assert str(e.value) == f"{p} line 3: not UTF-8"


def test_a_line_too_long_for_any_prompt_and_a_fifo_are_refused_before_anything_is_sent(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "MAX_LINE_BYTES", 1000)
    p = write(tmp_path, [PROMPT, {"prompt": "x" * 2000}, PROMPT])
    with pytest.raises(DataError) as e:
        dataset.load_dataset(p)
    assert str(e.value) == (f"{p} line 2: longer than 1,000 bytes, far beyond any prompt a server takes; "
                            "is it the right file?")
    fifo = tmp_path / "f.jsonl"
    os.mkfifo(fifo)  # reading it would wait for a writer for ever
    with pytest.raises(DataError) as e:
        dataset.load_dataset(fifo)
    assert str(e.value) == f"{fifo}: a named pipe (FIFO), not a regular file"


def test_bom_and_crlf_are_fine(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps(PROMPT).encode() + b"\r\n" + json.dumps(CHAT).encode() + b"\r\n")
    assert [e.line for e in dataset.load_dataset(p)] == [1, 2]


def test_missing_and_empty_files(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError) as e:
        dataset.load_dataset(missing)
    assert str(e.value) == f"{missing}: cannot read: No such file or directory"
    with pytest.raises(DataError, match="a folder, not a file"):
        dataset.load_dataset(tmp_path)
    empty = write(tmp_path, ["", "  "], "empty.jsonl")
    with pytest.raises(DataError) as e:
        dataset.load_dataset(empty)
    assert str(e.value) == f"{empty}: no entries"
    assert isinstance(e.value, ConfigError)


def test_unchanged_file_is_not_parsed_again(tmp_path, monkeypatch):
    p = write(tmp_path, [PROMPT, CHAT])
    first = dataset.load_dataset(p)
    calls = []
    monkeypatch.setattr(files.json, "loads", lambda s: calls.append(s) or json.JSONDecoder().decode(s))
    again = dataset.load_dataset(p)
    assert again == first and calls == []
    again.clear()
    assert len(dataset.load_dataset(p)) == 2  # a caller's change to its list is not the cache's
    write(tmp_path, [PROMPT, CHAT, SHAREGPT])
    assert len(dataset.load_dataset(p)) == 3 and len(calls) == 3


def test_resolve_path():
    assert files.resolve_path("@sharegpt-tiny.jsonl") == files.DATASETS_DIR / "sharegpt-tiny.jsonl"
    assert files.resolve_path("@chat-tiny") == files.DATASETS_DIR / "chat-tiny.jsonl"
    assert files.DATASETS_DIR == Path(files.__file__).parent / "datasets"
    assert files.resolve_path("~/x.jsonl") == Path.home() / "x.jsonl"
    assert files.resolve_path("rel/x.jsonl") == Path("rel/x.jsonl")
    with pytest.raises(DataError) as e:
        files.resolve_path("@nope.jsonl")
    assert "@nope.jsonl" in str(e.value) and "@chat-tiny.jsonl, @sharegpt-tiny.jsonl, @trace-tiny.jsonl" in str(e.value)
    with pytest.raises(DataError):
        files.resolve_path("@../workload.py")


# --- traces ----------------------------------------------------------------------------------------


ROW = {"timestamp": 0, "input_length": 40, "output_length": 5, "hash_ids": [1, 2, 3]}


def test_good_trace(tmp_path):
    rows = [ROW, "", {"timestamp": 250, "input_length": 7, "output_length": 1, "extra": "ok"},
            {"timestamp": 250.5, "input_length": 9, "output_length": 2, "hash_ids": []}]
    t = trace.load_trace(write(tmp_path, rows, "t.jsonl"))
    assert t == [TraceRow(1, 0.0, 40, 5, (1, 2, 3)), TraceRow(3, 0.25, 7, 1, ()), TraceRow(4, 0.2505, 9, 2, ())]
    assert trace.trace_offsets(t, 2.0) == pytest.approx([0.0, 0.5, 0.501])
    assert trace.trace_offsets([], 1.0) == []


def test_trace_offsets_start_at_the_first_row():
    rows = [TraceRow(1, 10.0, 1, 1, ()), TraceRow(2, 11.5, 1, 1, ())]
    assert trace.trace_offsets(rows, 0.5) == [0.0, 0.75]


def bad_trace(tmp_path, bad) -> str:
    p = write(tmp_path, [ROW, {**ROW, "timestamp": 300}, "", bad], "t.jsonl")
    with pytest.raises(DataError) as e:
        trace.load_trace(p)
    msg = str(e.value)
    assert msg.startswith(f"{p} line 4: ") and "\n" not in msg, msg
    return msg[len(f"{p} line 4: "):]


def test_trace_decreasing_timestamp(tmp_path):
    assert bad_trace(tmp_path, {**ROW, "timestamp": 120}) == "timestamp: 120 is before the previous line's 300"


def test_trace_missing_field(tmp_path):
    bad = {"timestamp": 400, "output_length": 3}
    assert bad_trace(tmp_path, bad).startswith("input_length: missing")


def test_trace_bool_is_not_an_int(tmp_path):
    assert bad_trace(tmp_path, {**ROW, "timestamp": 400, "output_length": True}).startswith("output_length: True")
    assert bad_trace(tmp_path, {**ROW, "timestamp": True}).startswith("timestamp: True")
    assert bad_trace(tmp_path, {**ROW, "timestamp": 400, "hash_ids": [1, False]}).startswith("hash_ids[1]: False")


def test_trace_nan_and_inf(tmp_path):
    assert bad_trace(tmp_path, '{"timestamp": NaN, "input_length": 4, "output_length": 1}').startswith("timestamp: nan")
    assert bad_trace(tmp_path, '{"timestamp": Infinity, "input_length": 4, "output_length": 1}').startswith(
        "timestamp: inf")
    assert bad_trace(tmp_path, '{"timestamp": 400, "input_length": NaN, "output_length": 1}').startswith(
        "input_length: nan")


def test_trace_other_bad_values(tmp_path):
    assert bad_trace(tmp_path, {**ROW, "timestamp": -1}).startswith("timestamp: -1 must be")
    assert bad_trace(tmp_path, {**ROW, "timestamp": 400, "input_length": 0}).startswith("input_length: 0 must be")
    assert bad_trace(tmp_path, {**ROW, "timestamp": 400, "input_length": 4.0}).startswith("input_length: 4.0 must")
    assert bad_trace(tmp_path, {**ROW, "timestamp": 400, "hash_ids": "12"}).startswith("hash_ids: expected a list")
    assert bad_trace(tmp_path, {**ROW, "timestamp": 400, "hash_ids": [-3]}).startswith("hash_ids[0]: -3")
    assert bad_trace(tmp_path, "[]").startswith("expected an object")
    assert bad_trace(tmp_path, "{,").startswith("not JSON")


def test_empty_trace(tmp_path):
    p = write(tmp_path, [""], "t.jsonl")
    with pytest.raises(DataError) as e:
        trace.load_trace(p)
    assert str(e.value) == f"{p}: no entries"


POOL = list(range(500, 800))


def test_trace_prompt_exact_length_and_shared_prefixes():
    a = trace.trace_prompt(TraceRow(1, 0.0, 50, 1, (7, 8, 9, 10)), POOL, 16, seed=0, index=0)
    b = trace.trace_prompt(TraceRow(2, 0.0, 70, 1, (7, 8, 11)), POOL, 16, seed=0, index=1)
    c = trace.trace_prompt(TraceRow(3, 0.0, 50, 1, (12, 8, 9, 10)), POOL, 16, seed=0, index=2)
    assert len(a) == 50 and len(b) == 70 and len(c) == 50
    assert all(t in POOL for t in a + b + c)
    assert a[:32] == b[:32]  # hash ids 7, 8 shared
    assert a[32:48] != b[32:48]  # 9 vs 11
    assert a[:16] != c[:16] and a[16:48] == c[16:48]  # same blocks give the same ids wherever they are
    assert b[48:] != trace.trace_prompt(TraceRow(2, 0.0, 70, 1, (7, 8, 11)), POOL, 16, seed=0, index=5)[48:]
    assert a != trace.trace_prompt(TraceRow(1, 0.0, 50, 1, (7, 8, 9, 10)), POOL, 16, seed=1, index=0)
    assert a == trace.trace_prompt(TraceRow(9, 5.0, 50, 3, (7, 8, 9, 10)), POOL, 16, seed=0, index=0)


def test_trace_prompt_without_hash_ids_is_unique_per_index():
    row = TraceRow(1, 0.0, 33, 1, ())
    x = trace.trace_prompt(row, POOL, 512, seed=0, index=0)
    y = trace.trace_prompt(row, POOL, 512, seed=0, index=1)
    assert len(x) == len(y) == 33 and x != y
    long_blocks = trace.trace_prompt(TraceRow(1, 0.0, 10, 1, (1, 2)), POOL, 512, seed=0, index=0)
    assert len(long_blocks) == 10


def test_cli_writes_examples(tmp_path, capsys):
    assert examples.main(["examples", str(tmp_path / "ex")]) == 0
    assert sorted(p.name for p in (tmp_path / "ex").iterdir()) == files.shipped_names()
    assert "sharegpt-tiny.jsonl" in capsys.readouterr().out
