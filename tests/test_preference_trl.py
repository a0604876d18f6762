"""Preference tuning against TRL (the pinned trl's DPOTrainer; SimPO: its CPOTrainer's own loss), in one spawned
process, for a random Llama and a Qwen3 (QK-norm, head dim 24) model:

pairs written by tools/preprocess_data.py --format preference (TRL's conversational layout, a system turn) ->
data.format=preference's packed sequences -> our policy (imported from the HF model) and a live reference (another
HF model, imported) -> the objective of every pair. TRL gets the same records, tokenizes them with the same chat
template and runs DPOTrainer.compute_loss on the policy and reference HF models. The token ids of every answer
are the same, and for sigmoid (DPO), IPO, hinge, robust, sigmoid + the SFT term and SimPO the loss, TRL's four
rewards metrics and logps, and every parameter's gradient (ours exported to HF names by the export path) agree
within 1e-5."""

import json
import sys
from pathlib import Path

import pytest
import torch
from harness import run_distributed

TOLERANCE = 1e-5
FAMILIES = {"llama": ("LlamaForCausalLM", "LlamaConfig", {}), "qwen3": ("Qwen3ForCausalLM", "Qwen3Config",
                                                                     {"head_dim": 24})}
SYSTEM = {"role": "system", "content": "Be brief."}
PAIRS = [("2+2?", "4.", "5, surely."), ("Capital of France?", "Paris.", "Lyon."), ("Say hi", "Hi!", "No."),
         ("Sky colour?", "Blue, mostly.", "Green."), ("3*3?", "9", "6 or so"), ("Opposite of up?", "Down.", "Left.")]
# (post.* overrides, TRL's loss_type / loss_weights / its config fields)
CASES = {"sigmoid": ({}, (["sigmoid"], None, {})),
         "ipo": ({"objective": "ipo"}, (["ipo"], None, {})),
         "hinge": ({"objective": "hinge"}, (["hinge"], None, {})),
         "robust": ({"objective": "robust", "label_smoothing": 0.2}, (["robust"], None, {"label_smoothing": 0.2})),
         "sigmoid+sft": ({"sft_weight": 0.5}, (["sigmoid", "sft"], [1.0, 0.5], {}))}
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def records() -> list[dict]:
    return [{"prompt": [SYSTEM, {"role": "user", "content": p}], "chosen": [{"role": "assistant", "content": c}],
             "rejected": [{"role": "assistant", "content": r}]} for p, c, r in PAIRS]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12)).item()


def _ours(state, objective, batch_of, case: dict) -> dict:
    """Our objective on every pair (one micro-batch of the packed sequences): loss, metrics, HF-named gradients."""
    from training.engine.step import forward_step
    from hf_interop import hf_named_grads
    from training.parallel.wrap import unwrap

    gpt = unwrap(state.model[0])
    for key, value in {"objective": "sigmoid", "beta": 0.1, "label_smoothing": 0.0, "sft_weight": 0.0, **case}.items():
        setattr(objective.post, key, type(getattr(objective.post, key))(value))
    gpt.zero_grad(set_to_none=True)
    streams = batch_of()
    totals = objective._prepare(streams, 1, torch.device("cpu"))  # the reference scores the pairs first
    batch = next(streams)
    output, _ = forward_step(iter([batch]), gpt)  # [b, s] token losses
    total, n, report = objective._loss(batch, totals, output)
    (total / n).backward()
    grads = hf_named_grads(state)  # the export path's names
    return {"loss": (total / n).item(), "metrics": objective._summary([report], torch.device("cpu")), "grads": grads,
            "answers": sorted(tuple(batch["tokens"][r, i].tolist() + [batch["labels"][r, i][-1].item()])
                              for r, i in _answer_spans(batch))}


def _answer_spans(batch):
    """(row, index tensor) of each answer's positions with their inputs from the first answer target."""
    for r in range(batch["answer_ids"].shape[0]):
        ids = batch["answer_ids"][r]
        for a in ids[ids >= 0].unique().tolist():
            where = (ids == a).nonzero().flatten()
            yield r, torch.arange(where[0].item(), where[-1].item() + 1)


def _trl(hf: Path, ref: Path, tok: Path, out: Path, loss_types, weights, extra: dict, simpo: bool = False) -> dict:
    import transformers
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    policy = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tok)
    args = DPOConfig(output_dir=str(out), report_to=[], beta=2.0 if simpo else 0.1, loss_type=loss_types,
                     loss_weights=weights, use_cpu=True, max_length=None, per_device_train_batch_size=len(PAIRS),
                     bf16=False, **extra)  # trl's default bf16=True autocasts the reference it prepares (not the
    # policy, which train() would prepare): its log-probs then differ from fp32's by ~1e-3 per answer (measured)
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(records()),
                         processing_class=tokenizer)
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(PAIRS))])
    model = trainer.model
    model.train()
    if simpo:  # TRL's SimPO: CPOTrainer's average log-probs and loss (cpo_alpha 0: no NLL term)
        from types import SimpleNamespace

        from trl.experimental.cpo import CPOTrainer

        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        mean = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
        chosen, rejected = mean.chunk(2)
        fake = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=0.5, beta=2.0, label_smoothing=0.0,
                               accelerator=SimpleNamespace(device=torch.device("cpu")))
        losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(fake, chosen, rejected)
        loss = losses.mean()
        metrics = {"rewards/chosen": chosen_rewards.mean().item(), "rewards/rejected": rejected_rewards.mean().item(),
                   "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
                   "rewards/margins": (chosen_rewards - rejected_rewards).mean().item()}
    else:
        loss = trainer.compute_loss(model, inputs)
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k in METRICS}
    loss.backward()
    ids, mask = inputs["input_ids"], inputs["completion_mask"]
    answers = []
    for row in range(ids.shape[0]):  # each answer's inputs and its last label, as ours are listed
        where = mask[row].nonzero().flatten()
        answers.append(tuple(ids[row, where[0].item() - 1:where[-1].item() + 1].tolist()))
    return {"loss": loss.item(), "metrics": metrics, "answers": sorted(answers),
            "grads": {n.removeprefix("module."): p.grad for n, p in model.named_parameters()}}


def _scenario(root: str) -> dict:
    import subprocess

    import transformers
    from chat_fixtures import chat_tokenizer
    from hf_interop import ARCH, ROOT, convert_main

    sys.path.insert(0, str(ROOT / "tools"))
    import convert_hf

    from models.shape import ModelShape
    from training import checkpoint
    from training.config.compose import compose
    from training.data.streams import micro_batch_streams
    from training.data.tokenizer import build_tokenizer
    from training.engine.build import build
    from training.parallel import dist as D
    from training.post import pairs
    from training.post.step import PreferenceObjective

    root, out = Path(root), {}
    tok = chat_tokenizer(root / "tok", "llama3")
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records()))
    done = subprocess.run([sys.executable, str(ROOT / "tools/preprocess_data.py"), "--format", "preference", "--input",
                           str(root / "pairs.jsonl"), "--output-prefix", str(root / "pairs"), "--tokenizer", str(tok)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    out["preprocess"] = done.stdout
    for family, (model_cls, config_cls, extra) in FAMILIES.items():
        for name, seed in (("hf", 5), ("ref_hf", 6)):  # the reference differs from the policy
            torch.manual_seed(seed)
            config = getattr(transformers, config_cls)(**ARCH, **extra, tie_word_embeddings=False)
            getattr(transformers, model_cls)(config).save_pretrained(root / family / name)
            transformers.AutoTokenizer.from_pretrained(tok).save_pretrained(root / family / name)  # as shipped
        for name in ("hf", "ref_hf"):  # the same architecture: one preset
            preset = f"{root / family}/conf/model/{family}_dpo{'' if name == 'hf' else '_ref'}.yaml"
            code = convert_main(convert_hf, ["import", "--hf-dir", str(root / family / name), "--out",
                                             str(root / family / f"{name}_ckpt"), "--preset-out", preset])
            assert code[0] == 0, code
        cfg = compose([f"hydra.searchpath=[file://{root / family}/conf]", f"model={family}_dpo", "post=dpo", "post.reference=live",
                       f"post.reference_load={root / family / 'ref_hf_ckpt'}", "data.format=preference",
                       f"data.paths=[{root / 'pairs'}]", f"data.tokenizer={tok}", "data.split='100,0,0'", "model.seq_length=192",
                       f"checkpoint.load={root / family / 'hf_ckpt'}", "checkpoint.finetune=true",
                       "checkpoint.dir=null"])
        with D.distributed(tp=1, pp=1, seed=cfg.train.seed, timeout_minutes=2) as info:
            state = build(cfg, ModelShape.of(cfg.model), info.device, train=False)
            checkpoint.maybe_load(cfg, state)
            objective = PreferenceObjective(cfg, state)
            data, _ = pairs.build(cfg, build_tokenizer(cfg.data.tokenizer), (1, 0), True)  # one epoch: each pair once
            rows = [data[i] for i in range(len(data))]
            batch_of = lambda: micro_batch_streams(1, [dict(r) for r in rows], 0, len(rows))  # noqa: E731
            cases = {**CASES, "simpo": ({"objective": "simpo", "beta": 2.0}, None)}
            ours = {case: _ours(state, objective, batch_of, post) for case, (post, _) in cases.items()}
            for case in ours:
                ours[case]["grads"] = {n: g.clone() for n, g in ours[case]["grads"].items()}
        out[family] = ours
    return out


def _theirs(root: str) -> dict:
    """TRL's side, in a process of its own (no Megatron-Core in it)."""
    root, out = Path(root), {}
    for family in FAMILIES:
        hf, ref, tok = root / family / "hf", root / family / "ref_hf", root / "tok"
        out[family] = {case: _trl(hf, ref, tok, root / family / case, *trl) for case, (_, trl) in CASES.items()}
        out[family]["simpo"] = _trl(hf, ref, tok, root / family / "simpo", ["sigmoid"], None, {}, simpo=True)
    return out


def compare(ours: dict, theirs: dict) -> dict:
    out = {}
    for family in FAMILIES:
        out[family] = {}
        for case in ours[family]:
            a, b = ours[family][case], theirs[family][case]
            assert a["answers"] == b["answers"], (family, case)  # the same token ids in every answer
            diffs = {"loss": abs(a["loss"] - b["loss"]) / abs(b["loss"])}
            # a DPO reward is beta x a difference of float32 sums of ~-35 nats: relative to what it is the difference
            # of (SimPO's, beta x a mean, has no difference)
            m, logps = b["metrics"], (abs(a["metrics"]["logps/chosen"]), abs(a["metrics"]["logps/rejected"]))
            sums = 0 if case == "simpo" else CASES[case][0].get("beta", 0.1) * max(logps)
            scale = {k: max(abs(v), 1e-3, sums if k.startswith("rewards/") else 0) for k, v in m.items()}
            diffs |= {k: abs(a["metrics"][k] - v) / scale[k] for k, v in m.items()}
            diffs |= {f"grad {n}": rel(g, b["grads"][n]) for n, g in a["grads"].items()}
            out[family][case] = (diffs, len(b["metrics"]), len(a["grads"]), len(b["grads"]))
    return out


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dpo_trl"))
    ours = run_distributed(_scenario, 1, (root,), timeout=900)[0]
    return {**compare(ours, run_distributed(_theirs, 1, (root,), timeout=900)[0]), "preprocess": ours["preprocess"]}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_preference_objectives_equal_trl(scenario, family):
    assert f"{len(PAIRS)} pairs" in scenario["preprocess"]
    for case, (diffs, metrics, ours, theirs) in scenario[family].items():
        assert metrics >= 4 and ours == theirs, (case, metrics, ours, theirs)  # every metric, every parameter
        bad = {k: f"{d:.2e}" for k, d in diffs.items() if not d <= TOLERANCE}
        assert not bad, (case, bad)
