"""Resume, on the fake llama-server (tests/support/fake_openai.py): a job taken up again keeps its finished levels
and their requests and measures only the rest; a changed spec is refused; a complete job is left alone;
`python -m kvexp resume DIR` runs the saved overrides again into the same folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import TINY

from kvexp.app.cli import main
from kvexp.app.resume import resume_args

from kvexp.app.compose import compose
from kvexp.results.store import ResultError, load_document
from kvexp.backends.pool import ServerPool
from kvexp.measure.runner import run_job

import fake_openai  # noqa: E402

LEVELS = ["scenario.concurrency=[1,2,4]", "scenario.requests=4"]


@pytest.fixture(autouse=True)
def _own_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("KVEXP_CALIBRATION", str(tmp_path / "calibration.json"))


@pytest.fixture
def fake(tmp_path) -> Path:
    return fake_openai.wrapper(tmp_path)


@pytest.fixture
def pool():
    p = ServerPool()
    yield p
    p.release()


def job(out: Path, fake: Path, pool: ServerPool, *overrides: str) -> dict:
    run_job(compose([*TINY, f"backend.binary={fake}", *LEVELS, *overrides]), out, pool=pool)
    return load_document(out / "result.json")[1]


def rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]


def test_only_missing_and_failed_levels_are_measured_again(tmp_path, fake, pool):
    out = tmp_path / "job"
    first = job(out, fake, pool)
    # what a run leaves when level 2 failed (error rate) and the sweep was stopped during level 4
    first["levels"][1]["status"] = "failed"
    del first["levels"][2]
    first["status"] = "partial"
    (out / "result.json").write_text(json.dumps(first))
    before = rows(out)
    (out / "requests.jsonl").write_text("".join(json.dumps(q) + "\n" for q in before if q["level"] != 4))
    pool.release()

    again = job(out, fake, pool, "resume=true")
    assert again["status"] == "complete" and again["config_hash"] == first["config_hash"]
    assert again["started_at"] == first["started_at"] and len(again["resumed_at"]) == 1
    assert [lv["concurrency"] for lv in again["levels"]] == [1, 2, 4]
    assert again["levels"][0] == first["levels"][0]  # kept as it was
    assert again["levels"][1]["status"] == "ok"
    after = rows(out)
    assert after[:4] == [q for q in before if q["level"] == 1 and not q["warmup"]]  # the same requests
    old_sent = {q["sent_s"] for q in before}
    remeasured = [q for q in after[4:] if not q["warmup"]]
    assert [q["level"] for q in remeasured] == [2] * 4 + [4] * 4
    assert not old_sent & {q["sent_s"] for q in remeasured}
    assert sum(q["warmup"] for q in after) == 1


def test_a_finished_repeat_is_kept_and_only_the_ones_after_it_are_measured(tmp_path, fake, pool):
    """scenario.repeats=2, stopped during level 2's second repeat: its first repeat is kept (it used to be
    measured again with the second), and the second sums up both."""
    out = tmp_path / "job"
    first = job(out, fake, pool, "scenario.repeats=2")
    assert [(lv["concurrency"], lv["repeat"]) for lv in first["levels"]] == [(c, r) for c in (1, 2, 4) for r in (0, 1)]
    kept = first["levels"][:3]
    first["levels"], first["status"] = kept, "partial"
    (out / "result.json").write_text(json.dumps(first))
    before = [q for q in rows(out) if not q["warmup"] and (q["level"], q["repeat"]) in {(1, 0), (1, 1), (2, 0)}]
    (out / "requests.jsonl").write_text("".join(json.dumps(q) + "\n" for q in before))
    pool.release()

    again = job(out, fake, pool, "scenario.repeats=2", "resume=true")
    assert again["status"] == "complete"
    assert again["levels"][:3] == kept
    assert [(lv["concurrency"], lv["repeat"]) for lv in again["levels"]] == [(c, r) for c in (1, 2, 4) for r in (0, 1)]
    assert again["levels"][3]["repeats"]["throughput_tok_s"]["n"] == 2  # level 2's second repeat sums up the kept first one too
    after = [q for q in rows(out) if not q["warmup"]]
    assert after[:12] == before
    assert [(q["level"], q["repeat"]) for q in after[12:]] == [(2, 1)] * 4 + [(4, 0)] * 4 + [(4, 1)] * 4


def test_a_changed_spec_is_refused(tmp_path, fake, pool):
    out = tmp_path / "job"
    job(out, fake, pool)
    saved = {f: (out / f).read_bytes() for f in ("result.json", "requests.jsonl")}
    with pytest.raises(ResultError) as e:
        job(out, fake, pool, "resume=true", "scenario.max_tokens=8")
    msg = str(e.value)
    assert msg.startswith(f"{out}: the spec changed since this job ran (config hash ")
    assert msg.endswith("resume refuses to mix results: use a new folder or remove this one") and "\n" not in msg
    assert {f: (out / f).read_bytes() for f in saved} == saved


def test_a_complete_job_is_left_alone(tmp_path, fake, pool):
    out = tmp_path / "job"
    job(out, fake, pool)
    pool.release()
    saved = (out / "result.json").read_bytes()
    job(out, fake, pool, "resume=true")
    assert pool.current is None  # no server was started
    assert (out / "result.json").read_bytes() == saved


def test_resume_command_on_a_run_folder(tmp_path, fake, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["kvexp"])
    run = tmp_path / "my run"
    assert main([*TINY, f"backend.binary={fake}", "scenario.requests=4", f"hydra.run.dir='{run}'"]) == 0
    r = load_document(run / "result.json")[1]
    r["levels"], r["status"] = r["levels"][:1], "partial"  # stopped during level 2
    (run / "result.json").write_text(json.dumps(r))
    assert resume_args(run) == [*TINY, f"backend.binary={fake}", "scenario.requests=4", f"hydra.run.dir='{run}'",
                                "resume=true"]
    assert main(["resume", str(run)]) == 0
    again = load_document(run / "result.json")[1]
    assert [lv["concurrency"] for lv in again["levels"]] == [1, 2] and again["resumed_at"]


def test_resume_args_of_a_sweep_folder(tmp_path):
    (tmp_path / "multirun.yaml").write_text(
        "hydra:\n  overrides:\n    hydra:\n    - hydra.sweep.dir=/elsewhere\n    - hydra.mode=MULTIRUN\n"
        "    - hydra.sweep.subdir=${hydra.job.num}\n"
        "    task:\n    - kv=fp16,q8_0\n    - resume=false\n    - scenario.concurrency=[1,2]\n")
    assert resume_args(tmp_path) == ["-m", "hydra.sweep.subdir=${hydra.job.num}", "kv=fp16,q8_0",
                                     "scenario.concurrency=[1,2]", f"hydra.sweep.dir={tmp_path}", "resume=true"]


def test_a_resumed_sweep_counts_only_the_jobs_it_ran_in_its_time():
    from datetime import datetime

    from kvexp.report.summary import sweep_timing, timing_line
    from kvexp.results.documents import JobResult

    def job(started: str, finished: str, total: float) -> dict:
        return {"status": "complete", "started_at": started, "finished_at": finished, "backend": {},
                "timing": {"server_start_s": 1.0, "warmup_s": 1.0, "measure_s": total - 3, "total_s": total}}

    earlier = job("2026-12-01T10:00:00Z", "2026-12-01T10:10:00Z", 600.0)  # measured before the resume
    now = job("2026-12-02T09:00:05Z", "2026-12-02T09:01:05Z", 60.0)
    earlier, now = JobResult.from_json(earlier), JobResult.from_json(now)
    t = sweep_timing([earlier, now], wall_s=70.0, since=datetime(2026, 12, 2, 9, 0, 0, 400000))
    assert (t["jobs"], t["earlier_jobs"], t["jobs_s"], t["parallel"], t["outside_jobs_s"]) == (1, 1, 60.0, False, 10.0)
    assert timing_line(t).endswith("; 1 job(s) finished in an earlier run of this folder, not counted")
    # without knowing when this run began, both count, and 660 s in 70 s of wall time looks parallel
    assert sweep_timing([earlier, now], wall_s=70.0)["parallel"] is True
