"""The verdict a reviewer reads first, and what every rendered output may not contain: a winner named
inside the noise, a figure a warning disqualifies printed as plain, a Python repr, "None" or "nan"."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import FIXTURES

from kvexp.analysis.findings import compute_findings
from kvexp.analysis.verdict import DRIFT_LIMIT, verdicts
from kvexp.metrics import registry
from kvexp.metrics.levels import Level
from kvexp.results.runs import Aggregate

# What no text a person reads may contain: Python's reprs and its names for nothing.
UNREADABLE = re.compile(r"\bNone\b|\bnan\b|\bNaN\b|\binf\b|\{'|': '|object at 0x|<kvexp\.")


def level(c, tput, spread=0.02, **kw):
    """A level whose TPOT spread sets its own noise: p95 = p50 x (1 + spread)."""
    return {"concurrency": c, "requests": 48, "errors": 0, "throughput_tok_s": tput, "ttft_p50_ms": 100.0,
            "ttft_p95_ms": 100.0 * (1 + spread), "tpot_p50_ms": 20.0, "tpot_p95_ms": 20.0 * (1 + spread),
            "status": "ok", **kw}


def run(label, kv, tputs, bytes_per_token=None, backend="llamacpp", model="m.gguf", scenario="chat", quality=None,
        spread=0.02):
    r = {"label": label, "backend": backend, "model": model, "scenario": scenario, "kv_requested": kv,
         "kv_cache": {"dtype": kv, "capacity_tokens": 1000,
                      "bytes": None if bytes_per_token is None else bytes_per_token * 1000},
         "levels": [level(c, t, spread) for c, t in tputs], "status": "complete"}
    if quality is not None:
        r["quality"] = {"kv": kv, "baseline": {"kv": "fp16"},
                        "teacher_forced": {"depths": [{"context": 512, "status": "ok", "kld_mean": quality}]}}
    return r


def test_a_clear_lead_is_the_verdict_and_says_the_noise_it_beat():
    agg = {"runs": [run("a", "fp16", [(1, 100), (4, 300)], 512), run("b", "q8_0", [(1, 100), (4, 200)], 272)]}
    (v,) = verdicts(Aggregate.from_json(agg))
    assert v.choice == ("llama.cpp fp16",)
    assert "run llama.cpp fp16 at concurrency 4" in v.why and "a measurable difference" in v.why
    assert v.caveat.startswith("Caveat: one run each: differences under 5 % are noise here; repeat with "
                               "scenario.repeats=3")


def test_a_difference_within_noise_is_a_tie_and_memory_decides():
    # +20 % throughput for fp16, but each level's own spread makes the threshold far larger
    agg = {"runs": [run("a", "fp16", [(4, 120)], 512, spread=3.0), run("b", "q8_0", [(4, 100)], 272, spread=3.0)]}
    (v,) = verdicts(Aggregate.from_json(agg))
    assert v.choice == ("llama.cpp q8_0",)
    assert "2 configurations tie" in v.why and "no measurable difference" in v.why
    assert "so KV memory decides: run llama.cpp q8_0" in v.why and "272 bytes per token against 512" in v.why
    assert "1.88x the tokens in the same memory" in v.why
    assert "leads" not in v.why


def test_drift_beyond_the_limit_drops_a_smaller_dtype_from_a_tie():
    runs = [run("a", "fp16", [(4, 100)], 512, spread=3.0), run("b", "q8_0", [(4, 101)], 272, spread=3.0),
            run("c", "q4_0", [(4, 102)], 144, spread=3.0),
            # the drift is measured in another scenario, on the same backend, model and KV dtype
            run("qb", "q8_0", [], 272, scenario="quality", quality=DRIFT_LIMIT / 10),
            run("qc", "q4_0", [], 144, scenario="quality", quality=DRIFT_LIMIT * 5)]
    chat = next(v for v in verdicts(Aggregate.from_json({"runs": runs})) if v.scenario == "chat")
    assert chat.choice == ("llama.cpp q8_0",), chat.why
    assert "mean KLD 0.001 at depth 512" in chat.why
    quality = next(v for v in verdicts(Aggregate.from_json({"runs": runs})) if v.scenario == "quality")
    assert quality.choice == ("llama.cpp q8_0",) and "within a mean KLD of 0.01" in quality.why


def test_equal_on_every_count_names_both():
    agg = {"runs": [run("a", "fp16", [(4, 100)], spread=3.0), run("b", "fp16", [(4, 101)], spread=3.0,
                                                                  backend="vllm")]}
    (v,) = verdicts(Aggregate.from_json(agg))
    assert set(v.choice) == {"llama.cpp fp16", "vLLM fp16"} and "either will do" in v.why


def test_a_burst_delivered_tpot_shows_the_servers_and_an_undersampled_peak_a_bound():
    lv = level(4, 100, tpot_p50_ms=0.02, server={"tpot_p50_ms": 21.5}, peak_kv_cache_usage=0.4,
               warnings=[{"code": "bursts", "text": "..."}, {"code": "kv_undersampled", "text": "..."}])
    shown = lambda d, key: registry.shown_value(Level.from_json(d), key)  # noqa: E731
    assert shown(lv, "tpot_p50_ms") == "21.50 (server)"
    assert shown(lv, "itl_p50_ms") == "— (bursts)"
    assert shown(lv, "peak_kv_cache_usage").startswith("≥ 40")
    assert shown(dict(lv, peak_kv_cache_usage=0.0), "peak_kv_cache_usage") == "— (under-sampled)"
    assert shown(level(4, 100), "tpot_p50_ms") is None


def rendered_texts(folder: Path) -> dict[str, str]:
    """Every text a person reads in a folder: Markdown, HTML, CSV, and the PDF page by page."""
    out = {str(p): p.read_text(encoding="utf-8") for ext in ("md", "html", "csv")
           for p in folder.rglob(f"*.{ext}")}
    for pdf in folder.rglob("*.pdf"):
        pages = int(re.search(r"Pages:\s+(\d+)", subprocess.run(["pdfinfo", str(pdf)], capture_output=True,
                                                                 text=True, check=True).stdout).group(1))
        for i in range(1, pages + 1):
            out[f"{pdf}#page{i}"] = subprocess.run(["pdftotext", "-f", str(i), "-l", str(i), str(pdf), "-"],
                                                   capture_output=True, text=True, check=True).stdout
    return out


def check_readable(folder: Path) -> None:
    texts = rendered_texts(folder)
    assert texts
    last = {}
    for name in texts:
        if "#page" in name:
            pdf, page = name.rsplit("#page", 1)
            last[pdf] = max(last.get(pdf, 0), int(page))
    for name, text in texts.items():
        bad = UNREADABLE.search(text)
        assert bad is None, f"{name}: {text[max(0, bad.start() - 80):bad.end() + 80]!r}"
        if "#page" in name and int(name.rsplit("#page", 1)[1]) < last[name.rsplit("#page", 1)[0]]:
            # a page is never nearly empty (the last one ends the document: nothing follows to fill it)
            assert len(text.split()) >= 40, f"{name}: {len(text.split())} words"
    for md in folder.rglob("report.md"):
        text = md.read_text()
        assert text.index("## Verdict") < text.index("## Findings")


@pytest.mark.skipif(shutil.which("pdftotext") is None, reason="pdftotext (poppler-utils) is not installed")
def test_the_reference_documents_report_reads_as_prose(tmp_path):
    from kvexp.app.cli import main

    assert main(["report", str(FIXTURES / "rtx5070ti-qwen2.5-7b.json"), "--out", str(tmp_path)]) == 0
    check_readable(tmp_path)
    html = (tmp_path / "report.html").read_text()
    assert html.index('id="verdict"') < html.index('id="findings"') and '<nav class="toc">' in html
    assert 'id="chart-chat-pareto-ttft"' in html


def test_capacity_is_compared_only_within_one_scenario_and_slot_count():
    """A chat job sized for 4 slots and a quality job sized for 16 hold different token counts whatever
    their dtype: the quality finding compares q8_0 with fp16 of the same scenario and slots."""
    from kvexp.analysis.qualityfindings import quality_findings

    def job(label, kv, scenario, seqs, tokens, nbytes, quality=None):
        r = run(label, kv, [], scenario=scenario, quality=quality)
        r["kv_cache"] = {"capacity_tokens": tokens, "bytes": nbytes, "seqs": seqs}
        return r

    runs = [job("chat-fp16", "fp16", "chat", 4, 4096, 4096 * 512),
            job("q-fp16", "fp16", "quality", 16, 36864, 36864 * 512, quality=0.0),
            job("q-q8_0", "q8_0", "quality", 16, 36864, 36864 * 272, quality=0.001)]
    (f,) = [f for f in quality_findings(Aggregate.from_json({"runs": runs})) if f.kind == "quality_trade"]
    assert "0.53× KV memory for the same tokens" in f.sentence and "9.00×" not in f.sentence


def test_a_lead_measured_under_other_machine_load_is_not_a_winner():
    a, b = run("a", "fp16", [(4, 300)], 512), run("b", "q8_0", [(4, 200)], 272)
    a["levels"][0]["machine"] = {"load_avg_1m": 1.9, "cores": 2, "busy_share": 0.9, "steal_share": 0.0}
    b["levels"][0]["machine"] = {"load_avg_1m": 4.1, "cores": 2, "busy_share": 1.0, "steal_share": 0.12}
    (v,) = verdicts(Aggregate.from_json({"runs": [a, b]}))
    assert "leads" not in v.why and "tie" not in v.why and v.choice == ()
    assert ("llama.cpp q8_0 (b): not compared, because the machine's load differed (load 4.1 on 2 cores, CPU steal "
            "12 % here, load 1.9 on 2 cores for a): not comparable") in v.excluded
    b["levels"][0]["machine"] = dict(a["levels"][0]["machine"])
    (v,) = verdicts(Aggregate.from_json({"runs": [a, b]}))
    assert "leads" in v.why and "load" not in v.caveat and not v.excluded


def test_a_kv_dtype_the_server_did_not_confirm_is_not_compared():
    a, b = run("a", "fp16", [(4, 300)], 512), run("b", "q8_0", [(4, 200)], 272)
    b["kv_cache"]["dtype"] = None
    (v,) = verdicts(Aggregate.from_json({"runs": [a, b]}))
    assert v.choice == () and v.excluded == ("llama.cpp q8_0 (b): not compared, because its server did not confirm "
                                             "the KV dtype asked for (q8_0): what ran is not known",)
    (f,) = [f for f in compute_findings(Aggregate.from_json({"runs": [a, b]})) if f.kind == "kv_unconfirmed"]
    assert f.runs == (str(b["label"]),) and "did not confirm its KV dtype (asked: q8_0)" in f.sentence
    b["kv_cache"]["dtype"] = "q8_0"
    (v,) = verdicts(Aggregate.from_json({"runs": [a, b]}))
    assert "confirm" not in v.caveat and not v.excluded
    assert not [f for f in compute_findings(Aggregate.from_json({"runs": [a, b]})) if f.kind == "kv_unconfirmed"]


def test_a_clear_lead_also_names_its_memory_per_token_as_written():
    agg = {"runs": [run("a", "q8_0", [(4, 300)], 272), run("b", "fp16", [(4, 200)], 512)]}
    (v,) = verdicts(Aggregate.from_json(agg))
    assert v.choice == ("llama.cpp q8_0",)
    assert "Its KV cache takes 272 bytes per token against 512 for llama.cpp fp16, 1.88x the tokens" in v.why


@pytest.mark.skipif(shutil.which("pdftotext") is None, reason="pdftotext (poppler-utils) is not installed")
def test_other_tools_runs_get_a_verdict_that_claims_only_what_they_hold(tmp_path):
    """vLLM's, GuideLLM's and AIPerf's files hold no KV memory: the verdict may not let memory decide."""
    from kvexp.app.cli import main

    assert main(["report", str(FIXTURES / "foreign"), "--out", str(tmp_path)]) == 0
    check_readable(tmp_path)
    verdict = (tmp_path / "report.md").read_text().split("## Verdict", 1)[1].split("##", 1)[0]
    assert "KV memory decides" not in verdict and "; ." not in verdict
    assert "guidellm: tiny" in verdict


def test_the_machines_cpu_shares_agree_with_psutils_over_the_same_interval():
    """level.machine's busy and steal shares, read from /proc/stat by kvexp, against psutil's own reading
    of the kernel's CPU times over the same interval (a truth kvexp did not compute)."""
    import time

    psutil = pytest.importorskip("psutil")
    from kvexp.core import machine

    if machine.cpu_times() is None:
        pytest.skip("no /proc/stat here")
    p0, m0 = psutil.cpu_times(), machine.cpu_times()
    end = time.perf_counter() + 0.5
    while time.perf_counter() < end:  # keep one core busy so that the busy share is not zero
        pass
    p1, m1 = psutil.cpu_times(), machine.cpu_times()
    view = machine.load_view(m0, m1)
    total = sum(p1) - sum(p0) - ((p1.guest + p1.guest_nice) - (p0.guest + p0.guest_nice))
    idle = (p1.idle + p1.iowait) - (p0.idle + p0.iowait)
    assert view is not None and view["cores"] >= 1
    assert abs(view["busy_share"] - (1 - idle / total)) < 0.05
    assert abs(view["steal_share"] - (p1.steal - p0.steal) / total) < 0.05
    assert view["busy_share"] > 0
