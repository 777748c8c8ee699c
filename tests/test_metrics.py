"""Metrics on known strings and distributions, and teacher forcing on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build_model
from helpers import prompt as random_prompt
from transformers import DynamicCache

from kvsieve import KVCache
from kvsieve.eval.metrics import (
    METRICS,
    answer_logprob,
    coarse_kl_per_position,
    first_number,
    first_number_match,
    kl_per_position,
    logprob_gap,
    mean_kl,
    string_match_all,
    string_match_part,
    token_logprobs,
    top_logprobs,
)
from kvsieve.eval.passes import teacher_forced_logprobs


def test_string_match_all_is_the_fraction_found_case_insensitive():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert string_match_all("ABCDE fghij", ["abcde", "FGHIJ"]) == 1.0
    assert string_match_all("nothing", ["x"]) == 0.0
    assert string_match_all("anything", []) == 0.0


def test_string_match_part_is_one_if_any_found():
    assert string_match_part("The answer is Paris.", ["paris", "London"]) == 1.0
    assert string_match_part("The answer is Rome.", ["Paris", "London"]) == 0.0


def test_first_number_exact_match():
    assert first_number("key: 68231. Remember 1") == "68231"
    assert first_number("none") is None
    assert first_number_match("68231 is it", ["68231"]) == 1.0
    assert first_number_match("682310", ["68231"]) == 0.0  # the whole first number must match
    assert first_number_match("7 then 68231", ["68231"]) == 0.0
    assert set(METRICS) == {"string_match_all", "string_match_part", "first_number"}


def test_answer_logprob_and_gap():
    logprobs = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]]))
    assert token_logprobs(logprobs, [0, 2]).tolist() == pytest.approx([math.log(0.5), math.log(0.7)])
    assert answer_logprob(logprobs, [0, 2]) == pytest.approx(math.log(0.35))
    assert logprob_gap(-1.0, -3.5) == 2.5


def test_kl_on_known_distributions():
    p = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    q = torch.log(torch.tensor([[0.9, 0.1], [0.9, 0.1]]))
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl_per_position(p, q).tolist() == pytest.approx([expected, 0.0], abs=1e-7)
    assert mean_kl(p, q) == pytest.approx(expected / 2, abs=1e-7)
    assert mean_kl(p, p) == 0.0
    assert mean_kl(p[:0], q[:0]) == 0.0
    with pytest.raises(ValueError):
        kl_per_position(p, q[:1])


def test_coarse_kl_is_exact_with_all_tokens_and_a_lower_bound_otherwise():
    generator = torch.Generator().manual_seed(0)
    p = torch.randn(6, 50, generator=generator).log_softmax(-1)
    q = (torch.randn(6, 50, generator=generator) * 2).log_softmax(-1)
    exact = kl_per_position(p, q)
    ids, top = top_logprobs(p, 50)
    assert torch.allclose(coarse_kl_per_position(ids, top, q), exact, atol=1e-9)
    ids, top = top_logprobs(p, 5)
    coarse = coarse_kl_per_position(ids, top, q)
    assert bool((coarse <= exact + 1e-9).all()) and bool((coarse > 0).all())
    assert coarse_kl_per_position(ids, top, p).abs().max() == 0.0


@pytest.fixture(scope="module")
def llama():
    return build_model("llama")


def test_teacher_forcing_matches_one_plain_forward(llama):
    ids = random_prompt(1, 30, seed=3)[0].tolist()
    prompt, answer = ids[:24], ids[24:]
    with torch.no_grad():
        plain = llama(torch.tensor([ids])).logits[0, 23:29].float().log_softmax(-1)
    batched = teacher_forced_logprobs(llama, DynamicCache(config=llama.config), prompt, answer)
    stepwise = teacher_forced_logprobs(llama, KVCache(llama, "full"), prompt, answer, stepwise=True)
    assert batched.shape == (6, llama.config.vocab_size)
    assert torch.allclose(batched, plain, atol=1e-5) and torch.allclose(stepwise, plain, atol=1e-5)
    assert mean_kl(plain, stepwise) < 1e-6  # float rounding only
    compressed = teacher_forced_logprobs(llama, KVCache(llama, "streaming_llm", budget=8), prompt, answer)
    assert mean_kl(plain, compressed) > 1e-4, mean_kl(plain, compressed)
