"""The pure maths of quality measurements (kvexp/quality/stats.py), the evaluation text, and the
parsers of llama-perplexity's output and of the serving APIs' answers."""

from __future__ import annotations

import math

import pytest

from kvexp.assets import evaltext
from kvexp.quality import continuations, perplexity, prompt_logprobs
from kvexp.quality import stats as qs

from conftest import FIXTURES, TINY


def _dist(*ps: float) -> dict[int, float]:
    return {i: math.log(p) for i, p in enumerate(ps)}


def test_topk_kld_of_identical_distributions_is_zero():
    p = qs.TopK(_dist(0.5, 0.3, 0.1))
    assert qs.topk_kld(p, p) == (0.0, True)


def test_topk_kld_matches_the_full_kld_when_the_rest_bucket_is_one_token():
    p, q = (0.5, 0.3, 0.2), (0.4, 0.4, 0.2)
    full = sum(a * math.log(a / b) for a, b in zip(p, q))
    # only the top 2 exposed: the third token is the rest bucket on both sides, so nothing is lost
    k, exact = qs.topk_kld(qs.TopK(_dist(*p[:2])), qs.TopK(_dist(*q[:2])))
    assert exact and k == pytest.approx(full, rel=1e-12)


def test_topk_kld_is_a_lower_bound_when_the_rest_is_merged():
    p, q = (0.5, 0.2, 0.2, 0.1), (0.5, 0.1, 0.3, 0.1)
    full = sum(a * math.log(a / b) for a, b in zip(p, q))
    k, exact = qs.topk_kld(qs.TopK(_dist(*p[:1])), qs.TopK(_dist(*q[:1])))
    assert exact and 0.0 <= k <= full


def test_a_baseline_token_missing_from_the_candidate_top_k_is_counted_inexact():
    base = qs.TopK({1: math.log(0.6), 2: math.log(0.3)})
    cand = qs.TopK({1: math.log(0.7), 3: math.log(0.2)})
    k, exact = qs.topk_kld(base, cand)
    assert not exact and k > 0
    # token 2 took the candidate's k-th probability (0.2): the same as giving it 0.2 explicitly
    assert k == pytest.approx(qs.topk_kld(base, qs.TopK({1: math.log(0.7), 2: math.log(0.2)}))[0])


def test_drift_summary_figures():
    base = [qs.TopK(_dist(0.7, 0.2)), qs.TopK(_dist(0.6, 0.3))]
    cand = [qs.TopK(_dist(0.7, 0.2)), qs.TopK(_dist(0.3, 0.6))]
    d = qs.drift(base, cand, targets=[0, 1])
    assert d.positions == 2 and d.kld_median == pytest.approx(d.kld_mean)
    assert d.kld_max == pytest.approx(2 * d.kld_mean)  # one position agrees exactly
    assert d.top1_agreement == 0.5
    assert d.ppl_base == pytest.approx(math.exp((-math.log(0.7) - math.log(0.3)) / 2))
    assert d.ppl == pytest.approx(math.exp((-math.log(0.7) - math.log(0.6)) / 2))
    assert d.delta_ppl == pytest.approx(d.ppl - d.ppl_base)
    with pytest.raises(ValueError, match="must be as many"):
        qs.drift(base, cand[:1], [0, 1])


def test_continuation_agreement():
    base = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]]
    cand = [[1, 2, 3, 4], [1, 9, 3, 4], [0, 6, 7, 8]]
    a = qs.continuation_agreement(base, cand)
    assert a.prompts == 3
    assert a.identical_share == pytest.approx(1 / 3)
    assert a.first_diff_mean == pytest.approx(0.5)  # positions 1 and 0
    assert a.prefix_agreement == pytest.approx((4 + 1 + 0) / 12)
    same = qs.continuation_agreement(base, base)
    assert (same.identical_share, same.first_diff_mean, same.prefix_agreement) == (1.0, None, 1.0)
    assert qs.first_difference([1, 2], [1, 2, 3]) == 2
    assert qs.continuation_agreement([], []).identical_share is None


def test_determinism_verdict():
    assert qs.deterministic(0.0, 1.0, 1.0) is True
    assert qs.deterministic(2e-6, 1.0, 1.0) is False
    assert qs.deterministic(None, None, 0.875) is False
    assert qs.deterministic(None, None, None) is None


def test_the_shipped_text_is_the_generators_output():
    assert evaltext.SHIPPED.read_text(encoding="utf-8") == evaltext.generate()
    assert evaltext.generate(seed=1) != evaltext.generate()
    text, sha, source = evaltext.load()
    assert len(text) >= evaltext.DEFAULT_CHARS and len(sha) == 64 and source == "kvexp's evaluation text"


def test_parse_llama_perplexity_kld_output():
    text = (FIXTURES / "llama_perplexity_kld_q4_0.txt").read_text()
    f = perplexity.parse_kld_output(text)
    assert f["chunks"] == 4 and f["positions"] == 4 * 255
    # the recorded run's own figures (q4_0 KV on the tiny quality GGUF, depth 512)
    assert (f["kld_mean"], f["kld_median"], f["kld_p99"], f["kld_max"]) == (0.056485, 0.035086, 0.295212, 0.469843)
    assert (f["ppl"], f["ppl_base"], f["delta_ppl"], f["kld_mean_err"]) == (38.188566, 38.190918, -0.002351, 0.001878)
    assert f["kld_median"] <= f["kld_p99"] <= f["kld_max"]
    assert 0 < f["top1_agreement"] <= 1
    assert f["delta_ppl"] == pytest.approx(f["ppl"] - f["ppl_base"], abs=1e-3)


def test_parse_llama_perplexity_base_run_and_a_text_too_short():
    f = perplexity.parse_ppl_output((FIXTURES / "llama_perplexity_base.txt").read_text())
    assert f["ppl"] is not None and f["chunks"] == 4
    short = perplexity.parse_ppl_output("perplexity: you need at least 8192 tokens to evaluate perplexity with a "
                                     "context of 4096\nperplexity: the data file you provided tokenizes to only "
                                     "5000 tokens\n")
    assert short["ppl"] is None and short["text_tokens"] == 5000
    # fewer than 100 scored positions: no statistics are printed, every figure is None, never 0
    few = perplexity.parse_kld_output("kl_divergence: computing over 1 chunks, n_ctx=64, batch_size=64, n_seq=1\n")
    assert few["chunks"] == 1 and few["positions"] == 31
    assert all(few[k] is None for k in ("kld_mean", "kld_p99", "top1_agreement", "ppl", "ppl_base"))


def test_parse_api_answers():
    toks, tops = _adapter("vllm").parse_continuation({"choices": [{"logprobs": {
        "tokens": ["token_id:5", "token_id:7"], "top_logprobs": [{"token_id:5": -0.1, "token_id:2": -2.5}, None]}}]})
    assert toks == [5, 7] and tops == [{5: -0.1, 2: -2.5}, None]
    toks, tops = _adapter("llamacpp").parse_continuation({"tokens": [3, 4], "completion_probabilities": [
        {"id": 3, "logprob": -0.2, "top_logprobs": [{"id": 3, "logprob": -0.2}, {"id": 9, "logprob": -1.9}]},
        {"id": 4, "logprob": -0.5, "top_logprobs": []}]})
    assert toks == [3, 4] and tops == [{3: -0.2, 9: -1.9}, None]
    chars, tops = _adapter("ollama").parse_continuation({"response": "ab"})
    assert chars == ["a", "b"] and tops == [None, None]
    plp = prompt_logprobs.parse_prompt_logprobs({"choices": [{"prompt_logprobs": [
        None, {"12": {"logprob": -0.5, "rank": 1, "decoded_token": "x"}}]}]})
    assert plp == [None, {12: -0.5}]
    with pytest.raises(ValueError, match="prompt_logprobs"):
        prompt_logprobs.parse_prompt_logprobs({"choices": [{}]})


def test_prompt_offsets_are_seeded_and_fit():
    a = continuations.prompt_offsets(1000, 64, 8, seed=3)
    assert a == continuations.prompt_offsets(1000, 64, 8, seed=3) != continuations.prompt_offsets(1000, 64, 8, seed=4)
    assert len(set(a)) == 8 and all(0 <= o <= 1000 - 64 for o in a)
    assert continuations.prompt_offsets(50, 64, 8, seed=3) == []


def _adapter(name: str):
    from kvexp import backends
    from kvexp.app.compose import compose

    return backends.adapter_class(name)(compose([*TINY, f"backend={name}", "model.ollama=tiny:latest"]), "/m", "/bin/x")
