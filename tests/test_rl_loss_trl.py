"""The GRPO family's loss = TRL 1.16's GRPOTrainer._compute_loss: for a small random Llama, the same prompts and
completions (right-padded completions of unequal lengths), advantages, and old and reference log-probs that differ
from the policy (so the clip and the KL bite), the loss and every parameter gradient agree within 1e-5 for the
grpo, dr_grpo and dapo aggregations, the KL with and without TRL's ratio correction. TRL runs in a process of its
own on the HF model; ours is the policy-gradient step's loss (training/post/rl/step.py) on our GPT imported from
that model by tools/convert_hf.py, its gradients exported to HF names by the export path.
Planted: the clip applied to the advantage's sign wrongly (max for min), padding counted in the token mean ->
each fails. Group advantages: GRPO's (r - mean) / (std + 1e-4), Dr. GRPO's r - mean and RLOO's leave-one-out."""

import sys
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from hf_interop import VOCAB

TOLERANCE = 1e-5
B, P, T = 6, 5, 7  # completions (2 prompts x 3), prompt and completion positions
CASES = {"grpo": dict(loss_type="grpo", beta=0.0), "dr_grpo": dict(loss_type="dr_grpo", beta=0.0),
         "dapo": dict(loss_type="dapo", beta=0.0, epsilon_high=0.28), "grpo-kl": dict(loss_type="grpo", beta=0.04),
         "dapo-kl": dict(loss_type="dapo", beta=0.04, epsilon_high=0.28),
         "grpo-kl-plain": dict(loss_type="grpo", beta=0.04, use_bias_correction_kl=False)}


def _inputs(vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    completion_ids = torch.randint(3, vocab, (B, T), generator=g)
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])
    return {"prompt_ids": torch.randint(3, vocab, (B, P), generator=g), "prompt_mask": torch.ones(B, P, dtype=torch.long),
            "completion_ids": completion_ids, "completion_mask": (torch.arange(T) < lengths[:, None]).long(),
            "advantages": torch.tensor([1.2, -0.7, 0.3, -1.5, 0.9, -0.2]),
            "offsets": torch.randn(B, T, generator=g) * 0.3, "ref_offsets": torch.randn(B, T, generator=g) * 0.2}


def _hf_logps(model, x: dict) -> torch.Tensor:
    """[B, T] the completion tokens' log-probs under an HF model, plain torch."""
    ids = torch.cat([x["prompt_ids"], x["completion_ids"]], 1)
    attention = torch.cat([x["prompt_mask"], x["completion_mask"]], 1)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, P - 1:-1].float()  # [B, T, V]
    return torch.log_softmax(logits, -1).gather(-1, x["completion_ids"].unsqueeze(-1)).squeeze(-1)


def _old_and_ref(root: str, x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The same old and reference log-probs for both sides: the HF policy's, offset."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(f"{root}/hf", dtype=torch.float32)
    with torch.no_grad():
        now = _hf_logps(model, x)
    return now + x["offsets"], now + x["ref_offsets"]


def _prepare(root: str) -> None:
    import transformers
    from chat_fixtures import chat_tokenizer
    from hf_interop import ARCH, ROOT, convert_main

    sys.path.insert(0, str(ROOT / "tools"))
    import convert_hf

    tok = chat_tokenizer(Path(root) / "tok", "llama3")
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**ARCH, tie_word_embeddings=False))
    model.save_pretrained(f"{root}/hf")
    transformers.AutoTokenizer.from_pretrained(tok).save_pretrained(f"{root}/hf")
    code = convert_main(convert_hf, ["import", "--hf-dir", f"{root}/hf", "--out", f"{root}/ckpt", "--preset-out",
                                     f"{root}/conf/model/rl_llama.yaml"])
    assert code[0] == 0, code


def _theirs(root: str) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    out = {}
    for case, extra in CASES.items():
        x = _inputs(VOCAB)
        old, ref = _old_and_ref(root, x)
        args = GRPOConfig(output_dir=f"{root}/{case}", report_to=[], use_cpu=True, bf16=False, num_generations=3,
                          per_device_train_batch_size=B, max_completion_length=T,
                          model_init_kwargs={"dtype": torch.float32}, **extra)
        trainer = GRPOTrainer(model=f"{root}/hf", reward_funcs=lambda completions, **_: [0.0] * len(completions),
                              args=args, train_dataset=Dataset.from_list([{"prompt": "hi"}] * B),
                              processing_class=AutoTokenizer.from_pretrained(f"{root}/tok"))
        trainer.current_gradient_accumulation_steps = 1
        inputs = {k: x[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")}
        inputs |= {"old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": x["completion_mask"].sum()}
        trainer.model.train()
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        out[case] = {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in trainer.model.named_parameters()}}
    return out


def rows(x: dict, old: torch.Tensor, ref: torch.Tensor) -> list[dict]:
    """Our rollout rows: prompt + completion as one sequence; the label at position P - 1 + t is completion token t."""
    seq = torch.cat([x["prompt_ids"], x["completion_ids"]], 1)  # [B, P + T]
    out = []
    for b in range(B):
        mask, o, r = torch.zeros(P + T - 1), torch.zeros(P + T - 1), torch.zeros(P + T - 1)
        mask[P - 1:] = x["completion_mask"][b].float()
        o[P - 1:], r[P - 1:] = old[b], ref[b]
        out.append({"tokens": seq[b, :-1], "labels": seq[b, 1:], "loss_mask": mask, "old_logps": o, "ref_logps": r,
                    "advantages": x["advantages"][b]})
    return out


def _ours(root: str) -> dict:
    from models.shape import ModelShape
    from training import checkpoint
    from training.config.compose import compose
    from training.data.streams import micro_batch_streams
    from training.engine.build import build
    from training.engine.step import forward_step
    from hf_interop import hf_named_grads
    from training.parallel import dist as D
    from training.parallel.wrap import unwrap
    from training.post.rl.loss import LossConfig
    from training.post.rl.step import PolicyGradient

    _prepare(root)
    cfg = compose([f"hydra.searchpath=[file://{root}/conf]", "model=rl_llama", f"model.seq_length={P + T - 1}",
                   f"data.tokenizer={root}/tok", f"checkpoint.load={root}/ckpt", "checkpoint.finetune=true",
                   "checkpoint.dir=null"])
    out = {}
    with D.distributed(tp=1, pp=1, seed=cfg.train.seed, timeout_minutes=2) as info:
        state = build(cfg, ModelShape.of(cfg.model), info.device, train=False)
        checkpoint.maybe_load(cfg, state)
        gpt = unwrap(state.model[0])
        for case, extra in CASES.items():
            x = _inputs(VOCAB)
            old, ref = _old_and_ref(root, x)
            objective = PolicyGradient(LossConfig(aggregation=extra["loss_type"], beta=extra["beta"],
                                                  epsilon_high=extra.get("epsilon_high", 0.2), max_completion_length=T,
                                                  kl_ratio=extra.get("use_bias_correction_kl", True)))
            gpt.zero_grad(set_to_none=True)
            gpt.train()
            batch = next(micro_batch_streams(1, rows(x, old, ref), 0, B))
            output, _ = forward_step(iter([batch]), gpt)  # [B, s] token losses
            loss, count, _ = objective._loss(batch, output)
            (loss / count).backward()  # Megatron-Core's per-token normalisation: the sum over the count
            grads = hf_named_grads(state)  # the export path's names
            out[case] = {"loss": (loss / count).item(), "grads": grads}
    return out


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("grpo_trl"))  # ours first: it writes the HF model and its import
    return run_distributed(_ours, 1, (root,), timeout=600)[0], run_distributed(_theirs, 1, (root,), timeout=600)[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_policy_loss_and_every_gradient_equal_trl(both, case):
    ours, theirs = both[0][case], both[1][case]
    scale = max(abs(theirs["loss"]), 1.0)  # a sum of O(1) terms (|advantage| ~ 1) that may nearly cancel
    assert abs(ours["loss"] - theirs["loss"]) <= TOLERANCE * scale, (ours["loss"], theirs["loss"])
    assert set(ours["grads"]) == set(theirs["grads"]), set(ours["grads"]) ^ set(theirs["grads"])
    for name, g in ours["grads"].items():
        t = theirs["grads"][name.removeprefix("module.")]
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
