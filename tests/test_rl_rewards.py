"""Rewards for RL (training/post/rl/rewards.py): the built-ins score what they say (math-verify's equivalences, the
final \\boxed{} answer, the format), the user's own function is found by import path and weighted in, and every
way a reward function can fail stops with one line naming it and the sample, never a silent zero."""

import sys
import textwrap

import pytest

from training.errors import ConfigError
from training.post.rl.rewards import Rewards, RewardError, final_answer

SAMPLES = [  # (completion, answer, math, exact_match, format)
    ("so x = \\boxed{\\frac{1}{2}}", "0.5", 1.0, 0.0, 1.0),
    ("The answer is $0.5$.", "1/2", 1.0, 0.0, 0.0),
    ("\\boxed{42}", "42", 1.0, 1.0, 1.0),
    ("we get \\boxed{x^2 + 1}", "1 + x^2", 1.0, 0.0, 1.0),
    ("\\boxed{41}", "42", 0.0, 0.0, 1.0),
    ("no idea", "7", 0.0, 0.0, 0.0),
    ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}", 1.0, 0.0, 1.0),
]


def samples(rows=SAMPLES) -> list[dict]:
    return [{"prompt": f"question {k}", "completion": c, "answer": a} for k, (c, a, *_rest) in enumerate(rows)]


def test_built_in_rewards_score_what_they_say():
    table, total = Rewards.of({"math": 1.0, "exact_match": 0.5, "format": 0.1})(samples())
    assert table["math"] == [r[2] for r in SAMPLES]
    assert table["exact_match"] == [r[3] for r in SAMPLES]
    assert table["format"] == [r[4] for r in SAMPLES]
    assert total == pytest.approx([r[2] + 0.5 * r[3] + 0.1 * r[4] for r in SAMPLES])
    assert final_answer("a \\boxed{1} then \\boxed{\\frac{3}{4}} end") == "\\frac{3}{4}"  # the last, braces balanced


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent('''
        def length(samples):
            return [len(s["completion"]) / 10 for s in samples]
        def raises(samples):
            raise KeyError("answer_text")
        def short(samples):
            return [1.0]
        def none_for_one(samples):
            return [1.0] * (len(samples) - 1) + [None]
        def nan(samples):
            return [float("nan")] * len(samples)
        NOT_A_FUNCTION = 3
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_rewards", None)


def test_a_users_function_by_import_path_is_weighted_in(user_module):
    table, total = Rewards.of({"my_rewards:length": 2.0, "format": 1.0})(samples(SAMPLES[:2]))
    assert table["my_rewards:length"] == [len(SAMPLES[0][0]) / 10, len(SAMPLES[1][0]) / 10]
    assert total == pytest.approx([2 * len(SAMPLES[0][0]) / 10 + 1.0, 2 * len(SAMPLES[1][0]) / 10])


@pytest.mark.parametrize("name, expected", [
    ("my_rewards:raises", "reward my_rewards:raises raised on a batch of 2 samples: KeyError: 'answer_text'"),
    ("my_rewards:short", "reward my_rewards:short returned list of 1 for 2 samples: it must return one float per "
                         "sample"),
    ("my_rewards:none_for_one", "reward my_rewards:none_for_one returned None for sample 1 (prompt 'question 1'): a "
                                "reward is a finite real number"),
    ("my_rewards:nan", "reward my_rewards:nan returned nan for sample 0 (prompt 'question 0'): a reward is a finite "
                       "real number"),
])
def test_a_failing_reward_stops_with_one_line_naming_it_and_the_sample(user_module, name, expected):
    with pytest.raises(RewardError) as err:
        Rewards.of({name: 1.0})(samples(SAMPLES[:2]))
    assert str(err.value) == expected and "\n" not in str(err.value)


@pytest.mark.parametrize("name, expected", [
    ("mathh", "reward 'mathh': not a built-in (exact_match, math, format) nor package.module:function"),
    ("no_such_module:f", "reward 'no_such_module:f': ModuleNotFoundError: No module named 'no_such_module'"),
    ("my_rewards:missing", "reward 'my_rewards:missing': AttributeError: module 'my_rewards' has no attribute"),
    ("my_rewards:NOT_A_FUNCTION", "reward 'my_rewards:NOT_A_FUNCTION': my_rewards.NOT_A_FUNCTION is a int, not a "
                                  "function"),
])
def test_a_reward_that_cannot_be_found_is_refused_before_anything_runs(user_module, name, expected):
    with pytest.raises(ConfigError) as err:
        Rewards.of({name: 1.0})
    assert str(err.value).startswith(expected), str(err.value)
