"""Prometheus text exposition, parsed with prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def parse_metrics(text: str) -> dict[str, float]:
    """Unlabelled-sum view: sample name -> value summed over label sets (counters, gauges)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


def labels_of(text: str, name: str) -> dict[str, str] | None:
    """Labels of the first sample called `name` (e.g. vllm:cache_config_info)."""
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                return dict(s.labels)
    return None
