"""RL (post.objective=grpo) trains the same model at every layout: from the same checkpoint and seed, the whole loop
(the policy's own rollouts, each completion from its own seeded generator; the rewards; the group advantages; the
old log-probs scored once; the clipped surrogate) at tp2, pp2 and dp2 with the distributed optimizer equals one
process for 3 steps: the same completions (their rewards and lengths, exactly), losses and grad norms. With two
updates a rollout batch (the second off-policy: the clip counts move) dp2 equals one process too. Planted: the
sampler seeded per DP rank -> the completions differ."""

import json
from pathlib import Path

import pytest
from harness import run_distributed
from rl_fixtures import PROMPTS
from runs import _train

BASE = ["model.num_layers=2", "model.seq_length=48", "train.micro_batch_size=2", "train.global_batch_size=8",
        "train.log_interval=1", "train.eval_interval=0", "train.tensorboard=false", "optim.warmup_iters=0",
        "optim.lr=1e-2", "train.iters=3", "post.objective=grpo", "post.rl.group_size=4", "post.rl.max_new_tokens=10",
        "post.rl.rewards=[rl_fixtures:digits]", "post.rl.top_k=40"]
LAYOUTS = {"tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"], "dp2-distopt": ["parallel.dist_opt=true"]}
EXACT = ("rl/reward", "rl/reward_std", "rl/completion_length")  # the same completions, exactly


def _runs(root: str, specs: list) -> dict:
    import os

    out = {}
    for name, overrides in specs:
        _train(overrides, f"{root}/{name}")
        if int(os.environ.get("RANK", 0)) == 0 and (Path(root) / name / "metrics.jsonl").exists():
            out[name] = [json.loads(line) for line in (Path(root) / name / "metrics.jsonl").read_text().splitlines()
                         if '"loss"' in line]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_layouts")
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    start = ["train.iters=0", "train.seed=3", f"checkpoint.dir={root}/start/checkpoints", "model.num_layers=2"]
    rl = BASE + [f"post.rl.prompts={root}/prompts.jsonl", f"checkpoint.load={root}/start/checkpoints",
                 "checkpoint.finetune=true", "checkpoint.dir=null"]
    twice = rl + ["post.rl.updates=2", "post.rl.epsilon_low=0.01", "post.rl.epsilon_high=0.01"]
    one = run_distributed(_runs, 1, (str(root), [("start", start), ("one", rl), ("one-updates2", twice)]),
                          timeout=900)[0]
    two = run_distributed(_runs, 2, (str(root), [(n, rl + extra) for n, extra in LAYOUTS.items()] +
                                     [("dp2-updates2", twice)]), timeout=900)[0]
    return {**one, **two}


def _same(ours: list, one: list, name: str) -> None:
    assert [r["iteration"] for r in ours] == [1, 2, 3] == [r["iteration"] for r in one], (name, ours)
    for a, b in zip(ours, one):
        for key in EXACT:
            assert a[key] == pytest.approx(b[key], abs=1e-12), (name, a["iteration"], key, a[key], b[key])
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6), (name, a["iteration"], a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (name, a["iteration"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_grpo_at_a_layout_equals_one_process(runs, layout):
    one = runs["one"]
    assert all(r["rl/reward_std"] > 0 and r["grad_norm"] > 0 for r in one), one  # a signal to learn from
    assert len({r["rl/reward"] for r in one}) == 3  # each step draws new completions
    _same(runs[layout], one, layout)


@pytest.mark.slow
def test_two_updates_a_rollout_batch_at_dp2_equal_one_process(runs):
    one = runs["one-updates2"]
    clipped = [r["rl/clip_low"] + r["rl/clip_high"] for r in one]
    assert one[0]["rl/reward"] == one[1]["rl/reward"]  # steps 1 and 2 train on one rollout batch
    assert clipped[0] == 0 < clipped[1] and clipped[2] == 0, clipped  # on-policy, off-policy, a fresh batch
    _same(runs["dp2-updates2"], one, "dp2-updates2")
