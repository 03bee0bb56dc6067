"""The demo task suite: answers recomputed independently, formats, and held-out prompts disjoint from training."""

import random

import pytest

from dgemma_compile.demo import tasks


@pytest.mark.parametrize("task", tasks.TASKS)
def test_sampled_answers_match_an_independent_computation(task):
    rng = random.Random(0)
    for _ in range(200):
        prompt, ans = tasks.sample(task, rng)
        assert prompt.startswith(task + " ") and prompt.endswith(tasks.SEPARATOR)
        assert set(prompt + ans) <= set(tasks.ALPHABET)
        body = prompt[len(task) + 1:-1]
        if task == "add":
            a, b = body.split("+")
            assert len(a) == len(b) == 3 and a.isdigit() and b.isdigit(), "operands are zero-padded to 3 digits"
            assert ans == "%04d" % (int(a) + int(b)), "the sum is zero-padded to 4 digits"
        else:
            xs = [int(x) for x in body.split(" ")]
            want = {"sort": sorted(xs), "rev": xs[::-1], "dedup": [x for i, x in enumerate(xs) if x not in xs[:i]]}
            assert [int(y) for y in ans.split(" ")] == want[task]
        assert tasks.check(prompt, " " + ans + " ") and tasks.answer(prompt) == ans
        assert not tasks.check(prompt, ans + "0")


@pytest.mark.parametrize("prompt", ["sort 1 2", "mul 2+3=", "add 5+7=", "add -05+003=", "add 1_0+002=",
                                    "add 999+0001=", "sort=", "sort 12 3=", "rev 1  2=", "dedup 1 x="])
def test_malformed_prompts_have_no_answer_and_check_false(prompt):
    with pytest.raises(ValueError, match="not a prompt of the task suite"):
        tasks.answer(prompt)
    assert not tasks.check(prompt, "")


def test_heldout_split_is_disjoint_from_train_balanced_and_prefix_stable():
    train = {p for _, p, _ in tasks.make_split("train", 4000, seed=0)}
    heldout = tasks.make_split("heldout", 400, seed=0, train_n=4000)
    prompts = [p for _, p, _ in heldout]
    assert not train & set(prompts) and len(set(prompts)) == len(prompts)
    assert [t for t, _, _ in heldout[:8]] == list(tasks.TASKS) * 2
    # one stream: a longer split extends a shorter one, and an offset slice is the same stream further on
    longer = tasks.make_split("heldout", 600, seed=0, train_n=4000)
    assert longer[:400] == heldout
    assert tasks.make_split("heldout", 150, seed=0, train_n=4000, offset=450) == longer[450:600]
    assert any(len(a) > 16 for t, _, a in heldout if t == "rev"), "some answers span two 16-token canvases"
@pytest.mark.slow
def test_validation_prompts_follow_the_test_prompts():
    test = tasks.make_split("heldout", tasks.VALIDATION_OFFSET, seed=0)
    val = tasks.make_split("heldout", 40, seed=0, offset=tasks.VALIDATION_OFFSET)
    assert tasks.VALIDATION_OFFSET == 500  # the README's test set is the first 500 held-out prompts
    assert val == tasks.make_split("heldout", 540, seed=0)[500:]
    assert not {p for _, p, _ in test} & {p for _, p, _ in val}


@pytest.mark.parametrize("kwargs, message", [(dict(name="heldout", n=-1), "n and offset must be >= 0"),
                                             (dict(name="heldout", n=1, offset=-1), "n and offset must be >= 0"),
                                             (dict(name="train", n=1, offset=3), "offset applies to the 'heldout'"),
                                             (dict(name="dev", n=1, offset=2), "split must be 'train' or 'heldout'")])
def test_make_split_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tasks.make_split(**kwargs)
