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
            assert len(a) == len(b) == 3 and len(ans) == 4, "operands and sum are zero-padded to 3 and 4 digits"
            assert int(ans) == int(a) + int(b)
        else:
            xs = [int(x) for x in body.split(" ")]
            want = {"sort": sorted(xs), "rev": xs[::-1], "dedup": [x for i, x in enumerate(xs) if x not in xs[:i]]}
            assert [int(y) for y in ans.split(" ")] == want[task]
        assert tasks.check(prompt, " " + ans + " ") and tasks.answer(prompt) == ans
        assert not tasks.check(prompt, ans + "0")


def test_check_rejects_malformed_prompts_instead_of_raising():
    assert not tasks.check("sort 1 2", "1 2")
    assert not tasks.check("mul 2+3=", "6")


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


def test_validation_prompts_follow_the_test_prompts():
    test = tasks.make_split("heldout", tasks.VALIDATION_OFFSET, seed=0)
    val = tasks.make_split("heldout", 40, seed=0, offset=tasks.VALIDATION_OFFSET)
    assert tasks.VALIDATION_OFFSET == 500  # the README's test set is the first 500 held-out prompts
    assert val == tasks.make_split("heldout", 540, seed=0)[500:]
    assert not {p for _, p, _ in test} & {p for _, p, _ in val}


@pytest.mark.parametrize("kwargs", [dict(name="heldout", n=-1), dict(name="heldout", n=1, offset=-1),
                                    dict(name="train", n=1, offset=3), dict(name="dev", n=1)])
def test_make_split_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        tasks.make_split(**kwargs)
