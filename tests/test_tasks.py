"""recipes.tasks and recipes.tool_tasks: rewards, determinism, supervised batches (multi-turn
ones loss-masked on observations), the calculator tool, registry errors."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recipes.tasks import AddTask, ReverseTask, TaskExample, get_task, score
from recipes.tool_tasks import CalculatorTask, calculator
from recipes.tool_tasks import get_task as get_tool_task
from rollout.tokenizers import ByteTokenizer


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer()


def test_reverse_examples_are_well_formed():
    task = get_task("reverse", min_len=2, max_len=4)
    for ex in task.sample_prompts(50, random.Random(1)):
        digits = ex.prompt[:-1]
        assert ex.prompt.endswith(">") and digits.isdigit() and 2 <= len(digits) <= 4
        assert ex.answer == digits[::-1]


def test_add_examples_are_well_formed():
    task = get_task("add", max_digits=2)
    for ex in task.sample_prompts(50, random.Random(2)):
        a, b = ex.prompt.rstrip("=").split("+")
        assert 0 <= int(a) <= 99 and 0 <= int(b) <= 99 and ex.prompt.endswith("=")
        assert ex.answer == str(int(a) + int(b))
        assert len(ex.answer) <= task.max_answer_chars


def test_rewards_exact_partial_wrong():
    task = ReverseTask()
    ex = TaskExample("1234>", "4321")
    assert task.reward("4321", ex) == 1.0
    assert task.reward("4321", ex, stopped=False) == pytest.approx(0.8 - 0.1)  # cut off
    assert task.reward("43219", ex) == pytest.approx(0.8 - 0.1)  # extra characters
    assert task.reward("43", ex) == pytest.approx(0.8 * 2 / 4)
    assert task.reward("4399", ex) == pytest.approx(0.8 * 2 / 4)
    assert task.reward("9321", ex) == 0.0  # the first character is wrong: no credit
    assert task.reward("", ex) == 0.0
    assert task.reward("9", ex, stopped=False) == 0.0  # floored at 0
    # Monotone: more correct leading characters never score lower.
    scores = [score("4321"[:k], "4321") for k in range(5)]
    assert scores == sorted(scores) and scores[-1] == 1.0
    assert all(0.0 <= s <= 1.0 for s in scores)


def test_add_reward():
    task = AddTask()
    ex = TaskExample("12+34=", "46")
    assert task.reward("46", ex) == 1.0
    assert task.reward("4", ex) == pytest.approx(0.4)
    assert task.reward("56", ex) == 0.0


def test_reward_tokens_uses_eos(tok):
    task = ReverseTask()
    ex = TaskExample("12>", "21")
    ids = tok.encode("21")
    assert task.reward_tokens([*ids, tok.eos_id], ex, tok) == 1.0
    assert (
        task.reward_tokens([*ids, tok.eos_id, *tok.encode("77")], ex, tok) == 1.0
    )  # after eos ignored
    assert task.reward_tokens(ids, ex, tok) == pytest.approx(0.7)  # no stop


def test_stopping_early_costs_every_missing_character():
    """Partial credit is over the whole answer: a short completion is credited only for what it
    produced, exactly as if the missing characters were wrong, and never reaches 1.0."""
    answer = "43210"
    for k in range(len(answer)):
        short = score(answer[:k], answer)
        assert short == pytest.approx(0.8 * k / len(answer)) and short < 1.0
        assert short == score(answer[:k] + "9" * (len(answer) - k), answer)  # missing == wrong
    assert score(answer[:4], answer) < score(answer, answer) == 1.0


def test_nothing_past_the_answer_is_rewarded(tok):
    task = ReverseTask()
    ex = TaskExample("1234>", "4321")
    exact = [*tok.encode("4321"), tok.eos_id]
    assert task.reward_tokens(exact, ex, tok) == 1.0
    for extra in (tok.encode("1"), [tok.pad_id], [tok.pad_id] * 3, [tok.bos_id], [0xE4, 0xB8]):
        ids = [*tok.encode("4321"), *extra, tok.eos_id]
        assert task.reward_tokens(ids, ex, tok) == pytest.approx(0.8 - 0.1), extra
    # A special token inside the answer breaks the prefix like any wrong character.
    ids = [*tok.encode("43"), tok.bos_id, *tok.encode("21"), tok.eos_id]
    assert task.reward_tokens(ids, ex, tok) == pytest.approx(0.8 * 2 / 4 - 0.1)


@settings(max_examples=200, deadline=None)
@given(
    answer=st.text("0123456789", min_size=1, max_size=6),
    body=st.lists(st.integers(0, 258), max_size=10),
    extra=st.lists(st.integers(0, 258).filter(lambda i: i != 257), min_size=1, max_size=4),
)
def test_reward_tokens_properties(answer, body, extra):
    """1.0 iff exactly the answer then eos; appending tokens past the answer never raises it."""
    tok = ByteTokenizer()
    task, ex = ReverseTask(), TaskExample(answer[::-1] + ">", answer)
    body = [i for i in body if i != tok.eos_id]
    r = task.reward_tokens([*body, tok.eos_id], ex, tok)
    assert 0.0 <= r <= 1.0
    assert (r == 1.0) == (body == tok.encode(answer))
    longer = task.reward_tokens([*body, *extra, tok.eos_id], ex, tok)
    assert (longer == 1.0) == ([*body, *extra] == tok.encode(answer))  # extra may complete it
    if len(tok.decode(body, skip_special_tokens=False)) >= len(answer):
        assert longer <= r


def test_sampling_is_deterministic_under_a_seed():
    for name in ("reverse", "add"):
        task = get_task(name)
        a = task.sample_prompts(20, random.Random(7))
        b = task.sample_prompts(20, random.Random(7))
        c = task.sample_prompts(20, random.Random(8))
        assert a == b and a != c
        assert task.sample_prompts(20, 7) == a  # an int seed is the same as Random(seed)


def test_supervised_batch_masks_only_answer_tokens(tok):
    task = ReverseTask(min_len=1, max_len=6)
    batch = task.supervised_batch(16, random.Random(3), tok)
    tokens, mask, plens = batch["tokens"], batch["loss_mask"], batch["prompt_lens"]
    assert tokens.dtype == torch.long and mask.dtype == torch.bool and tokens.shape == mask.shape
    exs = task.sample_prompts(16, random.Random(3))
    for i, ex in enumerate(exs):
        row = tokens[i].tolist()
        p = tok.encode(ex.prompt, add_bos=True)
        a = [*tok.encode(ex.answer), tok.eos_id]
        assert row[: len(p) + len(a)] == p + a
        assert all(t == tok.pad_id for t in row[len(p) + len(a) :])
        want = [False] * len(p) + [True] * len(a)
        want += [False] * (len(row) - len(want))
        assert mask[i].tolist() == want
        assert plens[i].item() == len(p)
        assert tok.decode(tokens[i][mask[i]].tolist()[:-1]) == ex.answer
    assert tokens.shape[1] <= task.max_prompt_tokens + task.max_new_tokens


def test_imperfect_demonstrator_reverses_only_its_share(tok):
    """demo_accuracy of the warm-start targets reverse, the rest copy the digits unreversed; the
    reward still asks for the reversal, so imitating the demonstrator is not solving the task."""
    task = get_task("reverse", min_len=4, max_len=4, demo_accuracy=0.3)
    rng = random.Random(5)
    exs = task.sample_prompts(4000, rng)
    demos = [task.demonstration(ex, rng) for ex in exs]
    assert all(d in (ex.answer, ex.prompt[:-1]) for ex, d in zip(exs, demos, strict=True))
    distinct = [(ex, d) for ex, d in zip(exs, demos, strict=True) if ex.answer != ex.prompt[:-1]]
    share = sum(d == ex.answer for ex, d in distinct) / len(distinct)
    assert 0.26 < share < 0.34, share  # binomial sd ~0.007
    copied = next(ex for ex, d in distinct if d != ex.answer)
    assert task.reward(copied.prompt[:-1], copied) < 1.0
    batch = task.supervised_batch(64, random.Random(6), tok)
    targets = {tok.decode(r[m].tolist()[:-1]) for r, m in zip(batch["tokens"], batch["loss_mask"], strict=True)}  # fmt: skip
    prompts = {tok.decode(r[1:p].tolist()) for r, p in zip(batch["tokens"], batch["prompt_lens"], strict=True)}  # fmt: skip
    assert targets & {p[:-1] for p in prompts}  # some targets are copies
    assert targets & {p[:-1][::-1] for p in prompts}  # and some are reversals


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.3", True, None])
def test_demo_accuracy_is_a_probability(bad):
    with pytest.raises(ValueError, match="demo_accuracy"):
        get_task("reverse", demo_accuracy=bad)


class _NoBosTokenizer(ByteTokenizer):
    """A byte tokenizer without a bos token that refuses to add one (as a strict HF wrapper)."""

    bos_id = None

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        if add_bos:
            raise ValueError("add_bos=True but this tokenizer has no bos token")
        return super().encode(text)


def test_prompts_start_without_bos_when_the_tokenizer_has_none():
    tok = _NoBosTokenizer()
    task = ReverseTask(min_len=3, max_len=3, demo_accuracy=0.5)
    ex = TaskExample("123>", "321")
    assert task.prompt_ids(ex, tok) == tok.encode("123>")
    batch = task.supervised_batch(8, random.Random(0), tok)
    assert (batch["prompt_lens"] == 4).all()  # three digits and ">", nothing in front
    assert 256 not in batch["tokens"].tolist()[0]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: get_task("sort"), r"unknown task 'sort'.*add.*reverse"),
        (lambda: get_task("add", min_len=3), "bad arguments for task 'add'"),
        (lambda: get_task("reverse", min_len=5, max_len=3), "max_len"),
        (lambda: get_task("reverse").sample_prompts(2, "seed"), "rng"),
    ],
    ids=["unknown-task", "bad-argument", "min-len-above-max-len", "seed-as-rng"],
)
def test_registry_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# -- tool tasks (recipes.tool_tasks) ---------------------------------------------------------------


def test_calculator_tool_evaluates_integer_arithmetic_only():
    assert calculator("4821*37") == "178377"
    assert calculator(" (2+3)*-4 // 3 % 5 ") == str((2 + 3) * -4 // 3 % 5)
    for bad, fragment in [("2**3", "unsupported"), ("1.5*2", "unsupported"), ("x*2", "unsupported"),
                          ("4821*", "not an expression"), ("7//0", "division by zero"),
                          ("9" * 20 + "*" + "9" * 20, "longer than")]:  # fmt: skip
        with pytest.raises(ValueError, match=fragment):
            calculator(bad)


def test_calculator_examples_and_budgets():
    task = get_tool_task("calculator", min_digits=3, max_digits=4, multiplier_digits=2)
    for ex in task.sample_prompts(50, random.Random(4)):
        a, b = ex.prompt.removesuffix("=").split("*")
        assert 100 <= int(a) <= 9999 and 10 <= int(b) <= 99 and ex.answer == str(int(a) * int(b))
        assert len(task.call_text(ex)) <= task.max_new_tokens
    assert task.call_text(TaskExample("4821*37=", "178377")) == "<calc>4821*37</calc>"
    assert task.max_new_tokens == len("<calc>9999*99</calc>")
    with pytest.raises(ValueError, match="demo_tool_rate"):
        get_tool_task("calculator", demo_tool_rate=1.5)
    with pytest.raises(ValueError, match="unknown task"):
        get_tool_task("search")


def test_calculator_warm_start_masks_the_observation(tok):
    """Tool demonstrations: call and answer (+ eos) trained, the calculator's result not; the
    result tokens are exactly what the environment appends in RL."""
    task = CalculatorTask(demo_tool_rate=1.0)
    ex = TaskExample("4821*37=", "178377")
    ids, trained = task.demonstration_tokens(ex, random.Random(0), tok)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text == "<calc>4821*37</calc>178377\n178377<eos>"
    untrained = tok.decode([i for i, t in zip(ids, trained, strict=True) if not t])
    assert untrained == "178377\n"
    env = task.env_factory(tok)({"prompt": task.prompt_ids(ex, tok), "example": ex})
    call = tok.encode("<calc>4821*37</calc>")
    obs = asyncio.run(env.step(call)).observation
    assert obs == [i for i, t in zip(ids, trained, strict=True) if not t]


def test_calculator_demonstrator_calls_the_tool_at_demo_tool_rate(tok):
    task = CalculatorTask(demo_tool_rate=0.3)
    rng = random.Random(5)
    demos = [task.demonstration_tokens(ex, rng, tok) for ex in task.sample_prompts(1000, 6)]
    calls = [tok.decode(ids).startswith("<calc>") for ids, _ in demos]
    assert 0.25 < sum(calls) / len(calls) < 0.35
    guesses = [tok.decode(ids) for (ids, _), c in zip(demos, calls, strict=True) if not c]
    assert all(g.isdigit() for g in guesses)  # a direct answer, one turn, eos trained
    batch = task.supervised_batch(32, random.Random(7), tok)
    assert batch["loss_mask"].sum() < (batch["tokens"] != tok.pad_id).sum()


def test_calculator_episode_rewards_the_final_answer(tok):
    task = CalculatorTask()
    ex = TaskExample("4821*37=", "178377")
    env = task.env_factory(tok)({})

    async def episode(turns: list[str]) -> list:
        await env.reset({"prompt": task.prompt_ids(ex, tok), "example": ex})
        return [await env.step([*tok.encode(t), tok.eos_id]) for t in turns]

    assert asyncio.run(episode(["178377"]))[0].reward == 1.0
    wrong = asyncio.run(episode(["482100"]))[0]
    assert wrong.done and wrong.reward == pytest.approx(task.reward("482100", ex))
