"""kvexp: which LLM server, KV-cache dtype and concurrency for your GPU, measured.

The public API: `results_frame` (levels of any mix of result files as a pandas DataFrame) and
`__version__`. The command line is `python -m kvexp`; everything else is internal (docs/ARCHITECTURE.md)."""

from kvexp.core import __version__

__all__ = ["__version__", "results_frame"]


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    if name == "results_frame":
        # lazy: importing kvexp (every server sampler and worker process does) must not load the report stack
        from kvexp.report.frame import results_frame

        return results_frame
    raise AttributeError(f"module 'kvexp' has no attribute {name!r}")
