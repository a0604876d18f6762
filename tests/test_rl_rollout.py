"""RL's embedded rollouts (training/post/rl/rollout.py): each completion's draws come from its own seeded generator,
so a completion is the same whether it is sampled in one batch, split over two (as over DP ranks) or in another
order; and the rollout rows put the loss on exactly the completion's tokens, which the step scores."""

import torch
from harness import run_distributed

PROMPTS = [[5, 9, 13], [7], [30, 31, 32, 33, 34], [5, 9, 13], [7], [30, 31, 32, 33, 34]]  # 3 prompts x 2 samples


def _rollouts(root: str) -> dict:
    from training.interop.generation import Sampling, generate, random_config
    from training.engine.build import build
    from training.parallel import dist as D
    from training.post.rl.rollout import rollout_rows, sample_seeds
    from training.post.rl.loss import LossConfig
    from training.post.rl.step import PolicyGradient
    from training.data.streams import micro_batch_streams
    from training.parallel.layout import Layout

    cfg, shape, _ = random_config(["model.num_layers=2", "model.seq_length=32", "train.micro_batch_size=6",
                                   "train.global_batch_size=6", "checkpoint=none"])
    sampling, out = Sampling(greedy=False, temperature=1.0, top_k=50), {}
    with D.distributed(tp=1, pp=1, seed=0, timeout_minutes=2) as info:
        state = build(cfg, shape, info.device, train=False)
        seeds = sample_seeds(1234, 0, range(len(PROMPTS)))
        run = lambda idx: generate(state, [PROMPTS[i] for i in idx], 12, sampling, -1, info.device,  # noqa: E731
                                   seeds=[seeds[i] for i in idx])
        out["whole"] = run(range(6))
        out["halves"] = run([0, 1, 2]) + run([3, 4, 5])
        out["reversed"] = run(range(5, -1, -1))[::-1]
        rows = rollout_rows(PROMPTS, out["whole"], [0.5] * 6, cfg.model.seq_length, 0)
        scored = PolicyGradient(LossConfig()).score(state, micro_batch_streams(1, rows, 0, 6), Layout.of(cfg, 1), cfg)
        out["rows"], out["scored"] = rows, scored[0]
        with torch.no_grad():  # the same log-probs from the logits directly
            ids = torch.stack([r["tokens"] for r in rows])
            logits = state.model[0](ids, None).float()[..., :shape.vocab_size]  # [b, s, V]
            out["direct"] = torch.log_softmax(logits, -1).gather(-1, torch.stack([r["labels"] for r in rows])[..., None])[..., 0]
    return out


def test_a_completion_is_the_same_in_any_batch_and_the_rows_score_its_tokens(tmp_path):
    out = run_distributed(_rollouts, 1, (str(tmp_path),), timeout=300)[0]
    assert out["whole"] == out["halves"] == out["reversed"], out
    assert out["whole"][0] != out["whole"][3]  # the same prompt, another seed: another completion
    for prompt, completion, row in zip(PROMPTS, out["whole"], out["rows"]):
        mask = row["loss_mask"].bool()
        assert row["labels"][mask].tolist() == completion  # the loss on exactly the completion's tokens
        assert row["tokens"][:len(prompt)].tolist() == prompt
    mask = torch.stack([r["loss_mask"] for r in out["rows"]]).bool()
    assert torch.allclose(out["scored"][mask], out["direct"][mask], atol=1e-5)
