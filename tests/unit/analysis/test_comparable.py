"""Comparable or not, decided before any ranking: hostile sets of valid result files (copies of two real
llama-server jobs on SmolLM2, smoke scenario, fp16 and q8_0 KV, edited as a reviewer would) never yield a
winner from runs that are not alike, and each run left out is named with its one reason."""

import copy
import json
import re
from pathlib import Path

import pytest
from conftest import FIXTURES

from kvexp.analysis.aggregate import collect
from kvexp.analysis.findings import compute_findings
from kvexp.results.documents import JobResult
from kvexp.results.runs import Aggregate, Run
from kvexp.results.validate import config_hash

REAL = FIXTURES / "decision"


def real(kv: str) -> dict:
    return json.loads((REAL / kv / "result.json").read_text())


def same_load(*docs: dict, load: float = 1.0) -> None:
    for d in docs:
        for lv in d["levels"]:
            lv["machine"] = {"load_avg_1m": load, "cores": 2, "busy_share": 0.9, "steal_share": 0.0}


def write(tmp: Path, docs: dict) -> list[Path]:
    out = []
    for name, d in docs.items():
        (tmp / name).mkdir(parents=True, exist_ok=True)
        (tmp / name / "result.json").write_text(json.dumps(d))
        out.append(tmp / name / "result.json")
    return out


def verdict_of(tmp: Path, docs: dict) -> dict:
    (v,) = collect(write(tmp, docs)).verdicts
    return v


def test_alike_real_runs_are_compared_and_one_is_chosen(tmp_path):
    a, b = real("fp16"), real("q8_0")
    same_load(a, b)
    v = verdict_of(tmp_path, {"a": a, "b": b})
    assert v["choice"] == ["llama.cpp q8_0"] and v["excluded"] == []


def test_the_real_pair_as_measured_under_other_load_is_not_comparable_and_never_a_tie(tmp_path):
    v = verdict_of(tmp_path, {"a": real("fp16"), "b": real("q8_0")})
    assert v["choice"] == [] and "tie" not in v["why"] and "no two runs can be compared" in v["why"]
    assert len(v["excluded"]) == 2
    assert all("not compared, because the machine's load differed" in x and x.endswith("not comparable")
               for x in v["excluded"])


def test_a_three_times_gap_under_other_machine_load_is_not_comparable(tmp_path):
    a, b = real("fp16"), real("q8_0")
    for lv_a, lv_b in zip(a["levels"], b["levels"]):
        lv_b["throughput_tok_s"] = 3 * lv_a["throughput_tok_s"]
        lv_a["machine"] = {"load_avg_1m": 1.9, "cores": 2, "busy_share": 0.9, "steal_share": 0.0}
        lv_b["machine"] = {"load_avg_1m": 4.1, "cores": 2, "busy_share": 1.0, "steal_share": 0.12}
    v = verdict_of(tmp_path, {"a": a, "b": b})
    assert v["choice"] == [] and "tie" not in v["why"] and "no measurable difference" not in v["why"]
    assert ("llama.cpp q8_0 (llamacpp-smollm2-q8_0-smoke): not compared, because the machine's load differed "
            "(load 4.1 on 2 cores, CPU steal 12 % here, load 1.9 on 2 cores for llamacpp-smollm2-fp16-smoke): "
            "not comparable") in v["excluded"]


def test_a_kv_dtype_the_server_did_not_confirm_never_wins(tmp_path):
    a, b = real("fp16"), real("q8_0")
    same_load(a, b)
    for k in ("dtype", "dtype_k", "dtype_v"):
        b["kv_cache"][k] = None
    v = verdict_of(tmp_path, {"a": a, "b": b})
    assert v["choice"] == [] and "272" not in v["why"] and "12,240" not in v["why"]
    assert v["excluded"] == ["llama.cpp q8_0 (llamacpp-smollm2-q8_0-smoke): not compared, because its server did "
                             "not confirm the KV dtype asked for (q8_0): what ran is not known"]


def test_different_weights_are_not_compared(tmp_path):
    a, b = real("fp16"), real("q8_0")
    same_load(a, b)
    b["model"].update(path="/models/SmolLM2-135M-Instruct.F16.gguf", weights_format="GGUF F16", bits_per_weight=16.0)
    v = verdict_of(tmp_path, {"a": a, "b": b})
    assert v["choice"] == [] and "no two runs can be compared" in v["why"]
    assert v["excluded"] == [
        "llama.cpp fp16, SmolLM2-135M-Instruct.Q4_1.gguf (llamacpp-smollm2-fp16-smoke): not compared, because other "
        "weights (GGUF Q4_1, 5.74 bits/weight, SmolLM2-135M-Instruct.Q4_1.gguf against GGUF F16, 16.00 bits/weight, "
        "SmolLM2-135M-Instruct.F16.gguf)",
        "llama.cpp q8_0, SmolLM2-135M-Instruct.F16.gguf (llamacpp-smollm2-q8_0-smoke): not compared, because other "
        "weights (GGUF F16, 16.00 bits/weight, SmolLM2-135M-Instruct.F16.gguf against GGUF Q4_1, 5.74 bits/weight, "
        "SmolLM2-135M-Instruct.Q4_1.gguf)"]


def test_an_interrupted_run_never_wins(tmp_path):
    a, b = real("fp16"), real("q8_0")
    same_load(a, b)
    b["status"], b["status_reason"] = "partial", "interrupted (SIGINT) after level 2"
    v = verdict_of(tmp_path, {"a": a, "b": b})
    assert v["choice"] == [] and "q8_0" not in v["why"]
    assert v["excluded"] == ["llama.cpp q8_0 (llamacpp-smollm2-q8_0-smoke): not compared, because it did not "
                             "finish (status partial: interrupted (SIGINT) after level 2); a partial run never wins"]
    agg = collect(write(tmp_path / "again", {"a": a, "b": b}))
    assert all(r["best"]["label"] != "llamacpp-smollm2-q8_0-smoke" for r in agg.recommendations)
    assert not [f for f in compute_findings(agg) if f.kind.startswith(("best", "kv_gain"))]


def test_identical_copies_are_one_run_said_once(tmp_path):
    b = real("q8_0")
    v = verdict_of(tmp_path, {"c1": b, "c2": copy.deepcopy(b), "c3": copy.deepcopy(b)})
    assert "tie" not in v["why"] and "only configuration measured" in v["why"]
    assert len(v["excluded"]) == 2 and all("an identical copy of llamacpp-smollm2-q8_0-smoke (1): one run, "
                                           "counted once" in x for x in v["excluded"])


def test_a_result_edited_after_it_was_written_is_refused_by_validate_report_and_resume(tmp_path, capsys):
    from kvexp.app.cli import main

    b = real("q8_0")
    b["config"]["scenario"]["requests"] = 80  # the hash kept
    (res,) = write(tmp_path / "sweep", {"1_job": b})
    (tmp_path / "sweep" / "multirun.yaml").write_text("hydra:\n  overrides:\n    hydra: []\n    task: [kv=q8_0]\n")
    for argv in (["validate", str(res)], ["report", str(res), "--out", str(tmp_path / "r")],
                 ["resume", str(tmp_path / "sweep")]):
        assert main(argv) == 1, argv
        err = capsys.readouterr()
        text = (err.out + err.err).strip()
        assert "$.config_hash: " in text and "does not match the config this file holds" in text, argv
        assert len([ln for ln in text.splitlines() if "config_hash" in ln]) == 1
    assert not (tmp_path / "r" / "report.md").exists()


def test_an_slo_the_lowest_level_misses_reads_the_same_in_terminal_and_report(tmp_path):
    from kvexp.report.render import render_report
    from kvexp.report.summary import end_of_run_text

    a, b = real("fp16"), real("q8_0")
    same_load(a, b)
    for d in (a, b):
        d["config"]["scenario"]["slo_ttft_ms"] = 10.0
        d["config_hash"] = config_hash(d["config"])  # as a run with that objective records it
    agg = collect(write(tmp_path, {"a": a, "b": b}))
    terminal = end_of_run_text(agg)
    assert "no job measured comparable levels" not in terminal
    assert "TTFT p95 ≤ 10 ms: missed at every level" in terminal
    assert [ln.split()[-4:] for ln in terminal.splitlines()[-2:]] == [["missed", "at", "every", "level"]] * 2
    render_report(agg, tmp_path / "report")
    report = (tmp_path / "report" / "report.md").read_text()
    assert "TTFT p95 ≤ 10 ms: missed at every level" in report.split("## Verdict", 1)[1].split("##", 1)[0]


def test_a_dispersed_level_says_so_instead_of_a_threshold_above_100_percent(tmp_path):
    a, b = real("fp16"), real("q8_0")
    same_load(a, b)
    for d in (a, b):
        for lv in d["levels"]:
            lv["tpot_p95_ms"] = lv["tpot_p50_ms"] * 60
            lv["tpot_p99_ms"] = lv["tpot_p50_ms"] * 61
    agg = collect(write(tmp_path, {"a": a, "b": b}))
    texts = [v["why"] + " " + v["caveat"] for v in agg.verdicts]
    texts += [f.sentence for f in compute_findings(agg)] + [r["sentence"] for r in agg.recommendations]
    joined = "\n".join(texts)
    assert "a level too dispersed to compare: run scenario.repeats=3 or more requests per level" in joined
    for m in re.finditer(r"(\d[\d,.]*) %", joined):
        assert "threshold" not in joined[max(0, m.start() - 40):m.start()] or float(m.group(1).replace(",", "")) <= 100


def test_a_cross_engine_comparison_says_first_that_engines_and_weights_differ(tmp_path):
    a = real("fp16")
    v = json.loads((FIXTURES / "foreign" / "kvexp" / "result.json").read_text())  # a real vLLM job (tiny, smoke)
    v["model"].update(path="/models/SmolLM2-135M-Instruct.Q4_1-bf16-b179c9523d0e", weights_format="bfloat16")
    v["environment"]["placement"] = a["environment"]["placement"]
    same_load(a, v)
    (verdict,) = collect(write(tmp_path, {"a": a, "v": v})).verdicts
    assert verdict["why"].startswith("Engines and weights differ together here (llama.cpp ")
    assert "vLLM 0." in verdict["why"].split(")", 1)[0] + verdict["why"]
    v["environment"]["placement"] = {"mode": "shared", "server_cpus": None, "client_cpus": None,
                                      "reason": "vLLM places its own threads"}
    (verdict,) = collect(write(tmp_path / "2", {"a": a, "v": v})).verdicts
    assert verdict["choice"] == [] and any("another CPU placement" in x for x in verdict["excluded"])


@pytest.mark.parametrize("status", ["failed", "skipped"])
def test_failed_and_skipped_jobs_are_named_never_ranked(tmp_path, status):
    a, b = real("fp16"), real("q8_0")
    same_load(a, b)
    b["status"], b["status_reason"] = status, "llama-server exited with status 1"
    v = verdict_of(tmp_path, {"a": a, "b": b})
    assert v["choice"] == [] and any(x.startswith("llama.cpp q8_0") for x in v["excluded"])


def test_memory_choosing_a_quantised_dtype_whose_quality_was_not_measured_says_so(tmp_path):
    a, b = real("fp16"), real("q8_0")
    same_load(a, b)
    for lv in a["levels"] + b["levels"]:  # the real levels' own spread: a tie, so memory decides
        lv["tpot_p95_ms"], lv["tpot_p99_ms"] = lv["tpot_p50_ms"] * 8, lv["tpot_p50_ms"] * 9
    v = verdict_of(tmp_path, {"a": a, "b": b})
    assert "so KV memory decides: run llama.cpp q8_0" in v["why"], v["why"]
    assert ("Its quality was not measured: q8_0 KV is chosen on memory alone; measure its drift from the 16-bit "
            "cache with `python -m kvexp -m backend=llamacpp kv=fp16,q8_0 scenario=quality`") in v["why"]


def test_a_verdict_resting_on_a_client_limited_or_bursty_level_says_so(tmp_path):
    a, b = real("fp16"), real("q8_0")
    same_load(a, b)
    for lv in b["levels"]:
        lv["client_limited"] = True
        lv["warnings"] = lv["warnings"] + [{"code": "bursts", "text": "server streamed in bursts", "values": {}}]
    v = verdict_of(tmp_path, {"a": a, "b": b})
    assert v["choice"] == ["llama.cpp q8_0"]
    assert ("the figure it rests on comes from a level flagged client-limited (the load generator, not the server, "
            "set the pace) and bursty") in v["caveat"]


def test_the_kv_dtype_card_on_real_runs_and_a_slowdown_beyond_the_noise_names_its_phase(tmp_path):
    from kvexp.report.render import render_report

    a, b = real("fp16"), real("q8_0")
    same_load(a, b)
    for la, lb in zip(a["levels"], b["levels"]):
        for d in (la, lb):  # a tight spread: a 5 % minimum effect is the noise
            d["ttft_p95_ms"] = d["ttft_p99_ms"] = d["ttft_p50_ms"] * 1.01
            d["tpot_p95_ms"] = d["tpot_p99_ms"] = d["tpot_p50_ms"] * 1.01
        lb["ttft_p50_ms"], lb["ttft_p95_ms"], lb["ttft_p99_ms"] = (la["ttft_p50_ms"] * 1.5,) * 3
        lb["tpot_p50_ms"] = la["tpot_p50_ms"] * 1.02
        lb["tpot_p95_ms"] = lb["tpot_p99_ms"] = lb["tpot_p50_ms"] * 1.01
    agg = collect(write(tmp_path, {"a": a, "b": b}))
    (card,) = agg.kv_cards
    base, q8 = card["rows"]
    assert (base["kv"], base["kv_bytes_per_token"]) == ("fp16", 23040)
    assert (q8["kv"], q8["kv_bytes_per_token"]) == ("q8_0", 12240)
    assert q8["tokens_in_same_memory"] == 11796480 // 12240 and q8["rotation"] == "rotated"
    marks = {k: [(c["x"], c["change_pct"], c["beyond_noise"]) for c in q8[k]] for k in ("ttft_change", "tpot_change")}
    assert marks == {"ttft_change": [(1, 50.0, True), (2, 50.0, True)],
                     "tpot_change": [(1, 2.0, False), (2, 2.0, False)]}
    (f,) = [f for f in compute_findings(agg) if f.kind == "kv_slowdown"]
    assert f.sentence.startswith("llama.cpp q8_0 KV vs fp16 (smoke, SmolLM2-135M-Instruct.Q4_1.gguf): prefill is "
                                 "slower, TTFT p50 +50.0 % at concurrency 1 (beyond the 5 % noise)")
    render_report(agg, tmp_path / "report")
    md = (tmp_path / "report" / "report.md").read_text()
    quality = md.split("## Quality", 1)[1]
    assert quality.split("\n###", 2)[1].startswith(" The KV-dtype card: llama.cpp, SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "| q8_0 | rotated | 12,240 | 963 (1.88×) | 1: +50.0 % (beyond the 5 % noise)" in quality
    assert json.loads((tmp_path / "report" / "comparison.json").read_text())["kv_cards"] == agg.kv_cards
    csv_text = (tmp_path / "report" / "comparison.csv").read_text()
    assert "card_ttft_p50_change_pct" in csv_text.splitlines()[0]


def test_a_model_served_by_two_backends_is_named_once_with_each_backends_weights(tmp_path):
    from kvexp.report.setup_view import default_title

    a = real("fp16")
    v = json.loads((FIXTURES / "foreign" / "kvexp" / "result.json").read_text())  # a real vLLM job (tiny, smoke)
    v["model"].update(path="/models/SmolLM2-135M-Instruct.Q4_1-bf16-b179c9523d0e", weights_format="bfloat16")
    title = default_title(collect(write(tmp_path, {"a": a, "v": v})))
    assert title.endswith("— SmolLM2-135M-Instruct.Q4_1 (llama.cpp: GGUF Q4_1, 5.74 bits/weight; vLLM: bfloat16)")


def test_the_card_carries_a_k_v_pair_with_the_kld_llama_perplexity_gives_by_hand():
    """A real sweep (`python -m kvexp -m kv=fp16,q8_0,q8_0/q4_0,q4_0 scenario=cpu quality.enabled=true`, SmolLM2):
    its fp16 and q8_0/q4_0 jobs. llama-perplexity run by hand with -ctk q8_0 -ctv q4_0 against the fp16 base
    file printed, at depth 4096: Mean KLD 0.007082, Same top p 94.317 %, Mean PPL(Q)-PPL(base) 0.071694; at 512:
    0.008120, 95.000 %, -0.107703."""
    base = json.loads((REAL / "cpu-fp16" / "result.json").read_text())
    pair = json.loads((REAL / "cpu-q8_0-q4_0" / "result.json").read_text())
    assert pair["kv"]["requested"] == "q8_0/q4_0" and pair["kv_cache"]["dtype"] == "q8_0/q4_0"
    assert "-ctk q8_0 -ctv q4_0" in " ".join(pair["backend"]["launch_command"])
    assert pair["kv_cache"]["bytes"] == pair["kv_cache"]["capacity_tokens"] * 9360  # K at q8_0 + V at q4_0
    depths = {d["context"]: d for d in pair["quality"]["teacher_forced"]["depths"]}
    d512 = depths[512]
    assert (d512["kld_mean"], d512["top1_agreement"], d512["delta_ppl"]) == (0.00812, 0.95, -0.107703)
    from kvexp.analysis.card import card_rows, kv_cards

    (card,) = kv_cards(Aggregate(runs=[collect_run(base), collect_run(pair)]))
    row = card["rows"][1]
    assert (row["kv"], row["kv_bytes_per_token"], row["depth"], row["kld_mean"], row["top1_agreement"],
            row["delta_ppl"], row["rotation"]) == ("q8_0/q4_0", 9360, 4096, 0.007082, 0.94317, 0.071694, "rotated")
    assert row["tokens_in_same_memory"] == base["kv_cache"]["bytes"] // 9360
    assert all(len(row[k]) == 2 for k in ("ttft_change", "tpot_change"))  # concurrency 1 and 4, each with its mark
    cells = card_rows(card)[1]
    assert cells[:4] == ["q8_0/q4_0", "rotated", "9,360", f"{base['kv_cache']['bytes'] // 9360:,} (2.46×)"]
    assert cells[6:] == ["0.00708 (depth 4096)", "94.317 %", "+0.07"]


def collect_run(doc: dict) -> Run:
    from kvexp.analysis.aggregate import run_of

    return run_of(JobResult.from_json(doc))
