"""Statistics against hand-computed values."""

from __future__ import annotations

import pytest

from kvexp.metrics import stats
from kvexp.metrics.records import RequestRecord


def rec(sent, first, done, out, prompt=4, times=None, error=None):
    r = RequestRecord(index=0, level=1, sent_s=sent, first_token_s=first, done_s=done, output_tokens=out,
                      prompt_tokens=prompt, target_prompt_tokens=4, max_tokens=out)
    r.token_times_s = times if times is not None else [first]
    if error:
        r.error_kind, r.error = error, "x"
    return r


def test_per_request_definitions():
    r = rec(1.0, 1.25, 2.25, 5, times=[1.25, 1.5, 1.75, 2.0, 2.25])
    assert stats.ttft_s(r) == pytest.approx(0.25)
    assert stats.e2e_s(r) == pytest.approx(1.25)
    assert stats.tpot_s(r) == pytest.approx(1.0 / 4)  # (1.25 - 0.25) / (5 - 1)
    assert stats.itls_s(r) == pytest.approx([0.25] * 4)


def test_tpot_needs_two_tokens_and_missing_is_none():
    assert stats.tpot_s(rec(0, 0.1, 0.2, 1)) is None
    assert stats.ttft_s(rec(0, None, 0.2, 0)) is None


def test_percentiles_interpolate_linearly():
    assert stats.percentile([1, 2, 3, 4], 50) == 2.5
    assert stats.percentile([10, 20, 30, 40, 50], 95) == pytest.approx(48.0)  # 40 + 0.8 * 10
    assert stats.percentile([], 50) is None


def test_level_summary_hand_computed():
    records = [
        rec(0.0, 0.1, 1.1, 11, times=[0.1 + 0.1 * i for i in range(11)]),
        rec(0.5, 0.8, 2.0, 11, prompt=4, times=[0.8 + 0.12 * i for i in range(11)]),
        rec(1.0, None, 1.5, None, error="http_status"),
    ]
    s = stats.summarize_level(records)
    assert s["requests"] == 3 and s["errors"] == 1
    assert s["errors_by_kind"] == {"http_status": 1}
    assert s["wall_s"] == 2.0  # first sent 0.0 -> last done 2.0
    assert s["throughput_tok_s"] == 11.0  # 22 tokens / 2 s
    assert s["ttft_p50_ms"] == 200.0  # median of 100 and 300 ms
    assert s["tpot_p50_ms"] == pytest.approx(110.0)  # median of (1100-100)/10 = 100 and (1500-300)/10 = 120 ms
    assert s["itl_p50_ms"] == pytest.approx(110.0)  # ten gaps of 100 ms, ten of 120 ms
    assert s["e2e_p50_ms"] == pytest.approx(1300.0)  # median of 1100 and 1500 ms
    assert s["mean_prompt_tokens"] == 4.0
    assert s["mean_output_tokens"] == 11.0


def test_no_success_gives_nulls_not_zeros():
    s = stats.summarize_level([rec(0, None, 1, None, error="timeout")])
    assert s["throughput_tok_s"] is None
    assert s["ttft_p50_ms"] is None and s["mean_prompt_tokens"] is None


def test_goodput_counts_requests_meeting_objectives():
    ok = rec(0, 0.05, 1.05, 11)
    slow = rec(0, 0.5, 1.5, 11)
    assert stats.goodput([ok, slow], 100.0, None, 2.0) == 0.5
    assert stats.goodput([ok, slow], None, None, 2.0) is None


def test_repeat_summary_confidence_interval():
    r = stats.repeat_summary([10.0, 12.0, 14.0])
    assert r["mean"] == 12.0
    assert r["ci95"] == pytest.approx(4.303 * 2.0 / 3 ** 0.5)
    assert r["cv"] == pytest.approx(2.0 / 12.0)
    assert stats.repeat_summary([None]) is None
