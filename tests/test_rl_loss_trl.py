"""The GRPO family's loss (training/post/rl/loss.py) = TRL 1.16's GRPOTrainer._compute_loss: for a small random
Llama, the same prompts and completions (left-padded prompts, right-padded completions of unequal lengths),
advantages and old and reference log-probs that differ from the policy (so the clip and the KL bite), the loss and
every parameter gradient agree within 1e-5 for the grpo, dr_grpo and dapo aggregations, with and without the KL.
TRL runs in a process of its own; ours reads the per-token log-probs of the same model with plain torch.
Planted: the clip applied to the advantage's sign wrongly (max for min), padding counted in the token mean ->
each fails. Group advantages: GRPO's (r - mean) / (std + 1e-4), Dr. GRPO's r - mean and RLOO's leave-one-out."""

import pytest
import torch
from harness import run_distributed

TOLERANCE = 1e-5
B, P, T = 6, 5, 7  # completions (2 prompts x 3), prompt and completion positions
CASES = {"grpo": dict(loss_type="grpo", beta=0.0), "dr_grpo": dict(loss_type="dr_grpo", beta=0.0),
         "dapo": dict(loss_type="dapo", beta=0.0, epsilon_high=0.28), "grpo-kl": dict(loss_type="grpo", beta=0.04),
         "dapo-kl": dict(loss_type="dapo", beta=0.04, epsilon_high=0.28),
         "grpo-kl-plain": dict(loss_type="grpo", beta=0.04, use_bias_correction_kl=False)}


def _inputs(vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, vocab, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[1, :2] = prompt_mask[4, :1] = 0  # left padding
    completion_ids = torch.randint(3, vocab, (B, T), generator=g)
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])
    completion_mask = (torch.arange(T) < lengths[:, None]).long()  # right padding
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": torch.tensor([1.2, -0.7, 0.3, -1.5, 0.9, -0.2]),
            "offsets": torch.randn(B, T, generator=g) * 0.3, "ref_offsets": torch.randn(B, T, generator=g) * 0.2}


def _model(root: str):
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float()


def _logps(model, x: dict) -> torch.Tensor:
    """[B, T] the completion tokens' log-probs, plain torch (positions from the attention mask, as TRL)."""
    ids = torch.cat([x["prompt_ids"], x["completion_ids"]], 1)
    attention = torch.cat([x["prompt_mask"], x["completion_mask"]], 1)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, P - 1:-1].float()  # [B, T, V]
    return torch.log_softmax(logits, -1).gather(-1, x["completion_ids"].unsqueeze(-1)).squeeze(-1)


def _theirs(root: str) -> dict:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    out = {}
    for case, extra in CASES.items():
        _model(root).save_pretrained(f"{root}/model")  # a path: with beta > 0 TRL loads its reference from it
        x = _inputs(64)
        args = GRPOConfig(output_dir=f"{root}/{case}", report_to=[], use_cpu=True, bf16=False, num_generations=3,
                          per_device_train_batch_size=B, max_completion_length=T,
                          model_init_kwargs={"dtype": torch.float32}, **extra)
        trainer = GRPOTrainer(model=f"{root}/model", reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                              train_dataset=Dataset.from_list([{"prompt": "hi"}] * B), processing_class=_tokenizer())
        trainer.current_gradient_accumulation_steps = 1
        with torch.no_grad():
            now = _logps(trainer.model, x)
        inputs = {k: x[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")}
        inputs |= {"old_per_token_logps": now + x["offsets"], "ref_per_token_logps": now + x["ref_offsets"],
                   "num_items_in_batch": x["completion_mask"].sum()}
        trainer.model.train()
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        out[case] = {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in trainer.model.named_parameters()}}
    return out


def _tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(64)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t3")),
                                  pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tok


def _ours(root: str) -> dict:
    from training.post.rl.loss import LossConfig, policy_loss

    out = {}
    for case, extra in CASES.items():
        model = _model(root)
        x = _inputs(model.config.vocab_size)
        with torch.no_grad():
            now = _logps(model, x)
        cfg = LossConfig(aggregation=extra["loss_type"], beta=extra["beta"], epsilon_low=0.2,
                         epsilon_high=extra.get("epsilon_high", 0.2), max_completion_length=T,
                         kl_ratio=extra.get("use_bias_correction_kl", True))
        model.train()
        logps = _logps(model, x)
        loss, count, _ = policy_loss(logps, now + x["offsets"], x["advantages"], x["completion_mask"], cfg,
                                     ref=now + x["ref_offsets"])
        mean = loss / count  # Megatron-Core's per-token normalisation: the gradient of the sum over the count
        mean.backward()
        out[case] = {"loss": mean.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    return out


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("grpo_trl"))
    return run_distributed(_ours, 1, (root,), timeout=600)[0], run_distributed(_theirs, 1, (root,), timeout=600)[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_policy_loss_and_every_gradient_equal_trl(both, case):
    ours, theirs = both[0][case], both[1][case]
    scale = max(abs(theirs["loss"]), 1.0)  # a sum of O(1) terms (|advantage| ~ 1) that may nearly cancel
    assert abs(ours["loss"] - theirs["loss"]) <= TOLERANCE * scale, (ours["loss"], theirs["loss"])
    assert ours["grads"].keys() == theirs["grads"].keys()
    for name, g in ours["grads"].items():
        t = theirs["grads"][name]
        assert ((g - t).abs().max() / t.abs().max().clamp(min=1e-12)).item() <= TOLERANCE, name


def test_group_advantages():
    from training.post.rl.loss import advantages

    r = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 5.0])  # two prompts, three completions each
    std = torch.tensor([1.0, 0.0, 0.0]).std()
    assert torch.allclose(advantages(r, 3, "grpo")[:3], (torch.tensor([1.0, 0.0, 0.0]) - 1 / 3) / (std + 1e-4))
    assert torch.allclose(advantages(r, 3, "dr_grpo"), torch.tensor([2 / 3, -1 / 3, -1 / 3, -1.0, -1.0, 2.0]))
    loo = torch.tensor([1 - 0.0, 0 - 0.5, 0 - 0.5, 2 - 3.5, 2 - 3.5, 5 - 2.0])  # r - the others' mean
    assert torch.allclose(advantages(r, 3, "rloo"), loo)
    assert torch.equal(advantages(torch.ones(6), 3, "grpo"), torch.zeros(6))  # a group all alike: no signal
