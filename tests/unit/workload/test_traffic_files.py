"""The user's own traffic files and settings, refused before anything runs: every bad dataset or trace line
by its number, a bad file at the CLI, bad workload settings in one line; a dataset's system messages and
reply lengths kept, and the warnings that qualify a level (the traffic itself on the real servers:
tests/integration/test_traffic.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY, with_tiny, ROOT

from kvexp.app.checks import check_config
from kvexp.app.compose import compose
from kvexp.core.config import ConfigError


def _bad(tmp: Path, name: str, lines: list[str]) -> Path:
    path = tmp / name
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = '{"conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "hi"}]}'


@pytest.mark.parametrize("bad, field", [
    ('{"conversations": [{"from": "robot", "value": "x"}]}', "conversations[0].from"),
    ('{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
    ("not json", "not JSON"),
    ('{"text": "x"}', '"messages", "conversations" or "prompt"'),
    ('{"prompt": "x", "output_tokens": 0}', "output_tokens"),
])
def test_every_bad_dataset_line_is_refused_with_its_number(tmp_path, bad, field):
    path = _bad(tmp_path, "d.jsonl", [GOOD, "", GOOD, bad])
    cfg = compose([*TINY, "scenario=sharegpt", f"scenario.dataset={path}"])
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert f"{path} line 4:" in str(e.value) and field in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("bad, field", [
    ('{"timestamp": 10, "input_length": 64}', "output_length"),
    ('{"timestamp": 10, "input_length": true, "output_length": 8}', "input_length"),
    ('{"timestamp": 1, "input_length": 64, "output_length": 8}', "timestamp"),
    ('{"timestamp": NaN, "input_length": 64, "output_length": 8}', "timestamp"),
    ('{"timestamp": 900, "input_length": 64, "output_length": 8, "hash_ids": [-1]}', "hash_ids"),
])
def test_every_bad_trace_line_is_refused_with_its_number(tmp_path, bad, field):
    good = ['{"timestamp": 0, "input_length": 64, "output_length": 8}',
            '{"timestamp": 500, "input_length": 64, "output_length": 8}']
    path = _bad(tmp_path, "t.jsonl", [*good, bad])
    cfg = compose([*TINY, "scenario=trace", f"scenario.trace={path}"])
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert f"{path} line 3:" in str(e.value) and field in str(e.value)


def test_a_bad_file_stops_the_cli_before_anything_runs(tmp_path):
    path = _bad(tmp_path, "d.jsonl", [GOOD, '{"conversations": [{"from": "gpt", "value": "no question"}]}'])
    out = subprocess.run([sys.executable, "-m", "kvexp", *with_tiny(["scenario=sharegpt", f"scenario.dataset={path}",
                          f"hydra.run.dir={tmp_path / 'run'}"])], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 1, out.stderr  # kvexp's status for a config that cannot run
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("kvexp:")]
    assert f"{path} line 2:" in line and "no user message" in line
    assert not (tmp_path / "run" / "result.json").exists()


@pytest.mark.parametrize("overrides, says", [
    (["scenario.prompt_dist.kind=uniform"], "scenario.prompt_dist: kind=uniform needs min and max"),
    (["scenario=prefix", "scenario.prefix_tokens=600"], "scenario.prefix_tokens=600"),
    (["scenario=multiturn", "scenario.conversation.turns=0"], "scenario.conversation.turns=0"),
    (["scenario=trace", "scenario.concurrency=[2]"], "a trace is its own schedule"),
    (["scenario=trace", "scenario.time_scale=0"], "scenario.time_scale=0"),
    (["scenario=sharegpt", "scenario.dataset=@nope"], "@nope"),
    (["scenario=multiturn", "backend.context=300", "backend.parallel=1"],
     "the scenario's longest request (prompt and output) = 480 tokens"),
    (["scenario=multiturn", "scenario.concurrency=[]", "scenario.rates=[0.5]"], "conversations run closed loop"),
    (["scenario=prefix", "scenario.prefix_groups=100"], "scenario.prefix_groups=100: more groups than the 24"),
    (["scenario=sharegpt", "scenario.prefix_tokens=100"], "scenario.dataset with scenario.prefix_tokens"),
    (["scenario=trace", "scenario.prompt_dist.kind=uniform", "scenario.prompt_dist.min=1",
      "scenario.prompt_dist.max=9"], "scenario.trace with scenario.prompt_dist"),
    (["scenario=trace", "scenario.time_scale=inf"], "scenario.time_scale=inf: must be > 0 and <= 1000"),
    (["scenario=trace", "scenario.requests=1"], "have one timestamp"),
    (["scenario=trace", "scenario.api=chat"], "replaying a trace needs token-id prompts"),
    (["scenario=trace", "scenario.trace_block_tokens=99999999"], "must be in 1..1,048,576"),
    (["scenario=sharegpt", "scenario.dataset=5"], "scenario.dataset: 5: cannot read"),
    (["scenario.prompt_dist.min=5"], "scenario.prompt_dist.min: kind=fixed does not use it"),
])
def test_bad_workload_settings_are_refused_in_one_line(overrides, says):
    with pytest.raises(ConfigError) as e:
        check_config(compose(overrides))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_json_array_file_is_named_as_such(tmp_path):
    path = _bad(tmp_path, "sharegpt.json", ['[{"conversations": [{"from": "human", "value": "hi"}]}]'])
    with pytest.raises(ConfigError) as e:
        check_config(compose([*TINY, "scenario=sharegpt", f"scenario.dataset={path}"]))
    assert "line 1: a JSON array: kvexp reads JSONL" in str(e.value) and "jq -c" in str(e.value)


def test_a_dataset_conversation_keeps_its_system_message_and_reply_lengths(tmp_path):
    """Turns of a dataset conversation, built without sending (Ollama's text prompts need no server)."""
    import asyncio

    from kvexp import backends
    from kvexp.measure.traffic import Traffic

    line = {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "one two"},
                              {"from": "gpt", "value": "x" * 40}, {"from": "human", "value": "three"},
                              {"from": "gpt", "value": "y" * 400}], "output_tokens": 7}
    longer = {"conversations": [{"from": "human", "value": w} for w in ("a", "b", "c")]}  # turns=3 is allowed
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(line) + "\n" + json.dumps(longer) + "\n")
    cfg = compose([*TINY, "backend=ollama", "backend.endpoint=http://127.0.0.1:9", "model.ollama=tiny", "scenario=sharegpt",
                   f"scenario.dataset={path}", "scenario.conversation.turns=3", "scenario.requests=1",
                   "scenario.concurrency=[1]"])
    check_config(cfg)
    backend = backends.create(cfg)

    async def turns():
        tr = Traffic(backend, None, cfg.scenario, None)
        await tr._load_dataset()
        (conv,) = (await tr.level(1, level=1, repeat=0)).conversations
        assert conv.turns == 2  # the first entry has two user messages: its own turns cap turns=3
        req0, rec0 = await conv.turn(0, None)
        rec0.text = ["an answer"]
        req1, rec1 = await conv.turn(1, rec0)
        return req0, rec0, req1, rec1

    req0, rec0, req1, rec1 = asyncio.run(turns())
    assert [m["role"] for m in req0.body["messages"]] == ["system", "user"]
    assert [m["content"] for m in req1.body["messages"]] == ["be brief", "one two", "an answer", "three"]
    assert rec0.max_tokens == 10  # the reply's length (40 characters, estimated at 4 a token)
    assert rec1.max_tokens == 7  # the entry's own output_tokens, for its last turn
    assert (rec0.turn, rec1.turn, rec0.conversation, rec1.source_line) == (0, 1, 0, 1)


def test_workload_warnings_name_what_qualifies_a_level():
    from kvexp.metrics.levels import workload_warnings

    codes = [w.code for w in workload_warnings(True, {"done": False, "how": "ollama offers no way"}, True, 3, 2, 8)]
    assert codes == ["cache_not_reset", "turns_not_sent", "entries_repeat"]
    assert workload_warnings(True, {"done": True, "how": "POST /reset_prefix_cache"}, True, 0, 40, 8) == []
    assert workload_warnings(True, None, False, 0, None, 8) == []  # nothing was sent before the first level
    assert workload_warnings(False, None, True, 0, None, 8) == []  # unique prompts: nothing to reset
