"""kvexp: which LLM server, KV-cache dtype and concurrency for your GPU, measured."""

__version__ = "0.1.0"
