"""kvexp: which LLM server, KV-cache dtype and concurrency for your GPU, measured."""

__version__ = "0.1.0"


def results_frame(paths):  # type: ignore[no-untyped-def]
    """A pandas DataFrame of levels from any mix of result files (kvexp.frame.results_frame)."""
    from kvexp.frame import results_frame as frame

    return frame(paths)
