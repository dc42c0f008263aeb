"""The telemetry sampler's windows stay with their levels: an answer that arrives after its request timed
out (a sampler starved beside a busy server) is dropped, not handed to the next level as its own."""

from __future__ import annotations

import multiprocessing

from kvexp.measure.telemetry import TelemetrySampler, Window


class _Alive:
    def is_alive(self) -> bool:
        return True


def test_a_late_answer_is_not_taken_for_the_next_window():
    parent, child = multiprocessing.Pipe()
    sampler = TelemetrySampler(adapter=None, base_url="http://127.0.0.1:1")
    sampler._conn, sampler._proc = parent, _Alive()  # the sampling process played by hand below

    late = sampler.window(timeout_s=0.01)  # nothing answers in time
    assert late.errors == ["the sampling process did not answer"]
    assert child.recv() == ("window", 1)
    child.send((1, Window(samples=3, peak_kv_usage=0.1)))  # the answer to that request, late

    child.send((2, Window(samples=7, peak_kv_usage=1.0)))  # the next request's own answer (sent ahead here)
    w = sampler.window(timeout_s=5)
    assert child.recv() == ("window", 2)
    assert (w.samples, w.peak_kv_usage, w.errors) == (7, 1.0, [])
