"""What a KV dtype costs in quality. measure.py runs one job's measurement (wanted, missing,
measure) over perplexity.py (llama-perplexity), prompt_logprobs.py (vLLM), continuations.py (greedy
continuations on every backend), cache.py (the baseline cache), job.py and servers.py (what they
share); stats.py is the pure maths."""
