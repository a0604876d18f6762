"""post=grpo's config rules (training/config/validate_rl.py): each mistake one line before any process starts; the
conf group composes a valid run once its prompts are named."""

import pytest
import torch.distributed as dist

from training.config.compose import compose
from training.config.validate import validate
from training.errors import ConfigError

INVALID = {  # name: (overrides, world, the line)
    "no-prompts": ([], 1, "post.objective=grpo trains on its own rollouts of prompts: set post.rl.prompts="),
    "missing-prompts": (["post.rl.prompts=/no/such.jsonl"], 1, "post.rl.prompts=/no/such.jsonl: no such file"),
    "group-of-one": (["post.rl.group_size=1"], 1, "post.rl.group_size=1 must be >= 2"),
    "batch-not-groups": (["post.rl.group_size=3"], 1, "train.global_batch_size=16 must be a multiple of "
                                                        "post.rl.group_size=3"),
    "weights-count": (["post.rl.reward_weights=[1.0,0.5]"], 1, "post.rl.reward_weights has 2 weights for 1 rewards"),
    "sequence-parallel": (["parallel.tp=2", "parallel.sp=true"], 2, "parallel.sp, parallel.vpp and parallel.cp are "
                                                                    "not taken yet"),
    "too-long": (["post.rl.max_new_tokens=128"], 1, "post.rl.max_new_tokens=128 must leave room for the prompt"),
    "top-p": (["post.rl.top_p=0"], 1, "post.rl.top_p=0.0 must be in (0, 1]"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_a_grpo_mistake_is_one_line_before_any_process_group(case, tmp_path):
    overrides, world, fragment = INVALID[case]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    named = [] if case in ("no-prompts", "missing-prompts") else [f"post.rl.prompts={prompts}"]
    with pytest.raises(ConfigError) as err:
        validate(compose(["post=grpo", *named, *overrides]), world)
    lines = str(err.value).splitlines()
    assert len([line for line in lines if fragment in line]) == 1, lines
    assert not dist.is_initialized()


def test_the_grpo_group_composes_a_valid_run(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cfg = compose(["post=grpo", f"post.rl.prompts={tmp_path / 'p.jsonl'}"])
    validate(cfg, 1)
    assert (str(cfg.post.objective), list(cfg.post.rl.rewards), cfg.post.rl.group_size) == ("grpo", ["math"], 4)
