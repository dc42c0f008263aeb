"""The timing-sensitive checks hold on a busy machine: a sample of them (an open-loop level and a hung server
on the real llama-server, the start-rate cap and the share of each second spent waiting for starts) run
again while another process keeps one core busy. They compare timings taken in the same run, never a
timing with a fixed number of milliseconds, so another process's load must not fail them."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from integration.llamacpp.test_faults_server import hung_server_ends_its_level
from integration.llamacpp.test_truth_llamacpp import open_loop_is_not_throttled
from unit.measure import test_loadgen, test_loadgen_waits


@pytest.mark.under_load
def test_timing_checks_hold_beside_a_busy_core(llama_server, tmp_path, loop_lags, monkeypatch):
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # the loop is on a core before the checks start
        t = time.monotonic()
        open_loop_is_not_throttled(llama_server, tmp_path / "open", loop_lags)
        test_loadgen.test_max_start_rate_caps_request_starts()
        test_loadgen_waits.test_overlapping_waits_yield_far_less_than_without_the_share(monkeypatch)
        hung_server_ends_its_level(tmp_path / "hung", workers=1)
        print(f"\nall checks beside a busy core in {time.monotonic() - t:.1f} s")
        assert busy.poll() is None  # the core stayed busy throughout
    finally:
        busy.kill()
        busy.wait(timeout=30)
