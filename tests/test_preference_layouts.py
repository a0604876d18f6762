"""Preference tuning trains the same model at every layout: DPO from a checkpoint, against a live reference that
differs from it, for 3 steps with clipping active, through the real loop (training.engine.loop.run: packed pairs
from disk, the reference's pass, Megatron-Core's schedules), at tp2, tp2+sp, tp2 with full recomputation, pp2,
pp2+vpp2, dp2 with the distributed optimizer and dp2 with Megatron-FSDP's ZeRO-3 equals one process: losses, grad
norms and TRL's rewards metrics; a mixture of experts (moe_tiny, its aux losses on) at ep2 likewise. LoRA-DPO with the base as
the reference (adapters off) likewise at tp2; and its first step, where the adapters are zero, is the policy scored
against itself (loss log 2, rewards 0) while a live reference equal to the base gives the same losses after.
post.reference=stored (scored once, at one process, pp2 or dp2) trains as the live reference. A reference
checkpoint of another model, and scores of another reference, are refused in one line. The memory estimate's live
reference term equals the bytes of the reference built on that pipeline stage's rank."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from harness import run_distributed
from runs import _train

RTOL = 1e-5  # loss, grad norm, logps: DP / TP sum in another order
REWARD_ATOL = 2e-6  # beta x (logp - ref): a difference of sums of ~-80 nats (TP: 5e-7 measured, 6e-9 of a sum)
BASE = ["model.seq_length=64", "train.micro_batch_size=2", "train.global_batch_size=8", "train.log_interval=1",
        "train.eval_interval=0", "train.tensorboard=false", "optim.warmup_iters=0", "optim.lr=1e-3",
        "optim.clip_grad=0.3", "checkpoint.dir=null", "data.format=preference", "post=dpo"]
LAYOUTS = {"tp2": ["parallel.tp=2"], "tp2-sp": ["parallel.tp=2", "parallel.sp=true"], "pp2": ["parallel.pp=2"],
           "pp2-vpp2": ["parallel.pp=2", "parallel.vpp=2"], "dp2-distopt": ["parallel.dist_opt=true"],
           "dp2-zero3": ["parallel.fsdp=optim_grads_params"], "tp2-recompute": ["parallel.tp=2", "model.recompute=full"]}
EVAL = ["train.eval_interval=3", "train.eval_iters=2"]  # stored-eval: its file (stored-one's) has no valid table
HALVES = ["data.split='50,50,0'", "train.eval_interval=3", "train.eval_iters=1"]  # a held-out half, evaluated
MOE = ["model=moe_tiny", "model.num_layers=2"]  # 8 experts top-2, the aux and z losses on
LORA = ["peft=lora", "peft.rank=4", "peft.alpha=8", "optim.lr=1e-2"]
KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen")


def pairs(prefix: Path, count: int = 64, seed: int = 0) -> None:
    """`count` pairs of random byte text: a 3-11 token prompt shared, answers of 4-29 tokens."""
    from training.data.sft_write import write_sft
    from training.data.tokenizer import build_tokenizer

    byte = build_tokenizer("byte")

    class ByteChat:
        name, vocab_size, eod, template_hash = byte.name, byte.vocab_size, byte.eod, "none"

    rng, conversations = np.random.default_rng(seed), []
    for _ in range(count):
        p = int(rng.integers(3, 12))
        prompt = rng.integers(32, 127, p)
        for _side in range(2):
            a = int(rng.integers(4, 30))
            conversations.append((np.r_[prompt, rng.integers(32, 127, a)].astype(np.uint16),
                                  np.r_[np.zeros(p, np.uint8), np.ones(a, np.uint8)]))
    write_sft(prefix, conversations, ByteChat(), "preference")


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "loss" in line]


def _runs(root: str, specs: list[tuple[str, list[str]]]) -> dict:
    """Each (name, overrides) trained in turn in this process group; rank 0 returns {name: records}."""
    from training.post import reference

    out, built, live_model = {}, [], reference.live_model

    def measured(cfg, state):  # the live reference's bytes on this rank, against the memory estimate's
        chunks, config = live_model(cfg, state)
        built.append(sum(p.numel() * p.element_size() for chunk in chunks for p in chunk.parameters()))
        return chunks, config

    reference.live_model = measured
    for name, overrides in specs:
        built.clear()
        _train(overrides, f"{root}/{name}")
        rank = int(os.environ.get("RANK", 0))
        Path(f"{root}/{name}/reference_bytes.{rank}.json").write_text(json.dumps(built))  # each rank its own
        if rank == 0:
            out[name] = records(Path(root) / name) if (Path(root) / name / "metrics.jsonl").exists() else []
    return out


def _refused(root: str) -> list[str]:
    from runs import train_catching

    common = BASE + [f"data.paths=[{root}/pairs]", f"checkpoint.load={root}/policy/checkpoints",
                     "checkpoint.finetune=true", "train.iters=1"]
    return [train_catching(common + [f"post.reference_load={root}/other/checkpoints"], f"{root}/refused"),
            train_catching(common + [f"post.reference_logps={root}/scored_pp2.npz",
                                     f"post.reference_load={root}/policy/checkpoints"], f"{root}/refused2")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference_layouts")
    pairs(root / "pairs")
    make = [(name, [f"train.seed={seed}", "train.iters=0", f"checkpoint.dir={root / name}/checkpoints"] + extra)
            for name, seed, extra in (("policy", 1, []), ("reference", 2, []),
                                      ("other", 3, ["model.num_layers=2"]),  # a checkpoint of another model
                                      ("moe-policy", 1, MOE), ("moe-reference", 2, MOE))]
    data = BASE + [f"data.paths=[{root / 'pairs'}]", "train.iters=3", f"checkpoint.load={root}/policy/checkpoints",
                   "checkpoint.finetune=true"]
    stored = data + [f"post.reference_load={root}/reference/checkpoints"]  # post=dpo's default: scored once, one model
    dpo = stored + ["post.reference=live"]  # a frozen copy beside the policy, scored every step
    lora = data + LORA + ["post.reference=lora_base"]
    moe = [o for o in data if not o.startswith("checkpoint.load")] + MOE + [
        f"checkpoint.load={root}/moe-policy/checkpoints", f"post.reference_load={root}/moe-reference/checkpoints"]
    lora_live = data + LORA + ["post.reference=live", f"post.reference_load={root}/policy/checkpoints"]  # = the base
    one = run_distributed(_runs, 1, (str(root), make + [("one", dpo), ("lora-one", lora), ("lora-live", lora_live),
                                                        ("stored-one", stored),
                                                        ("moe-one", moe),
                                                        *[(f"{name}-scored", data + HALVES + [  # its log-probs
                                                            f"post.reference_load={root}/{name}/checkpoints",
                                                            f"post.reference_logps={root}/scored_{name}.npz"])
                                                          for name in ("policy", "reference")],
                                                        ("stored-eval", stored + EVAL), ("live-eval", dpo + EVAL)]),
                          timeout=900)[0]
    two = run_distributed(_runs, 2, (str(root), [(name, dpo + extra) for name, extra in LAYOUTS.items()] +
                                     [("lora-tp2", lora + ["parallel.tp=2"]),
                                      ("stored-pp2", stored + ["parallel.pp=2", f"post.reference_logps={root}/scored_pp2.npz"]),
                                      ("stored-dp2", stored + [f"post.reference_logps={root}/scored_dp2.npz"]),
                                      ("moe-ep2", moe + ["parallel.ep=2"])]),
                          timeout=900)[0]
    return {**one, **two, "root": root, "refused": run_distributed(_refused, 1, (str(root),), timeout=300)[0]}


def _assert_same(runs: dict, name: str, reference: str) -> None:
    ours, one = runs[name], runs[reference]
    assert [r["iteration"] for r in ours] == [1, 2, 3] == [r["iteration"] for r in one], (name, ours)
    for a, b in zip(ours, one):
        for key in KEYS:
            tol = dict(abs=REWARD_ATOL) if key.startswith("rewards/") else dict(rel=RTOL)
            assert a[key] == pytest.approx(b[key], **tol), (name, a["iteration"], key, a[key], b[key])
        assert a["rewards/accuracies"] == b["rewards/accuracies"], (name, a["iteration"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_dpo_at_a_layout_equals_one_process(runs, layout):
    one = runs["one"]
    assert one[0]["rewards/margins"] != 0 and one[0]["loss"] != pytest.approx(math.log(2))  # a reference unlike it
    assert all(r["grad_norm"] > 0.3 for r in one)  # clipping active (optim.clip_grad=0.3)
    _assert_same(runs, layout, "one")


@pytest.mark.slow
def test_lora_dpo_against_its_base_equals_one_process_and_a_live_base(runs):
    first = runs["lora-one"][0]
    assert first["loss"] == pytest.approx(math.log(2), rel=1e-6) and first["rewards/margins"] == 0  # B = 0: itself
    _assert_same(runs, "lora-tp2", "lora-one")
    _assert_same(runs, "lora-live", "lora-one")  # the adapters-off pass = a frozen copy of the base


@pytest.mark.slow
@pytest.mark.parametrize("name", ["stored-one", "stored-pp2", "stored-dp2"])
def test_stored_reference_log_probs_train_as_the_live_reference(runs, name):
    _assert_same(runs, name, "one")


@pytest.mark.slow
def test_a_stored_file_without_the_validation_split_scores_it_and_evaluates_as_the_live_reference(runs):
    evals = {name: [r for r in runs[name] if "val_loss" in r] for name in ("stored-eval", "live-eval")}
    assert [r["iteration"] for r in evals["live-eval"]] == [3], evals
    for a, b in zip(evals["stored-eval"], evals["live-eval"], strict=True):
        for key in ("val_loss", "val_rewards/margins", "val_rewards/chosen", "val_logps/chosen"):
            assert a[key] == pytest.approx(b[key], rel=RTOL, abs=REWARD_ATOL), (key, a[key], b[key])
    assert evals["live-eval"][0]["val_rewards/margins"] != 0


def test_a_reference_of_another_model_or_scores_of_another_reference_are_refused_in_one_line(runs):
    other, scores = runs["refused"]
    assert other.startswith("error: post.reference_load: the model in the config") and "\n" not in other, other
    assert "num_layers: checkpoint 2 vs config 4" in other and "so it is the policy's model" in other, other
    assert "set these model.*" not in other, other  # the policy's config is right: the reference is not
    assert scores.startswith("error: post.reference_logps=") and "another reference (reference: " in scores, scores


@pytest.mark.slow
def test_dpo_of_a_mixture_of_experts_at_ep2_equals_one_process(runs):
    _assert_same(runs, "moe-ep2", "moe-one")


def test_the_memory_estimate_counts_the_live_reference_as_built_and_stored_scores_hold_none(runs):
    from models.shape import ModelShape
    from training.config.compose import compose
    from training.estimate.memory import estimate
    from training.parallel.layout import Layout

    live = ["post.reference=live"]
    for name, overrides, world in (("one", live, 1), ("tp2", live + ["parallel.tp=2"], 2),
                                   ("pp2", live + ["parallel.pp=2"], 2), ("stored-dp2", [], 2)):
        cfg = compose(BASE + ["data.paths=[x]", "post.reference_load=x"] + overrides)
        est = estimate(cfg, ModelShape.of(cfg.model, 257), Layout.of(cfg, world))
        built = [json.loads(f.read_text()) for f in sorted((runs["root"] / name).glob("reference_bytes.*.json"))]
        assert len(built) == world, built  # per rank: [bytes] of each live reference built
        if name.startswith("stored"):  # scored once by a reference that is freed: training holds one model
            assert est.reference == 0 and all(len(b) == 1 for b in built), built
        else:
            on_stage = built[est.stage * world // est.layout.pp][0]  # a rank of the estimate's pipeline stage
            assert on_stage == est.reference > 0, (name, built, est.stage, est.reference)


LAUNCHED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _evaluate(*args: str) -> dict:
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHED}  # a tool run in-process may have set them
    proc = subprocess.run([sys.executable, "tools/evaluate.py", "--json", *args], cwd=root, capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_evaluate_pairs_gives_the_preference_accuracy_of_the_stored_scores_at_any_layout(runs):
    """tools/evaluate.py --pairs: every held-out pair once, = TRL's metrics computed here from the policy's and the
    reference's stored per-pair log-probs (scored by the training runs), at one process and at tp2."""
    root = runs["root"]
    args = ["--ckpt", f"{root}/policy/checkpoints", "--pairs", f"{root}/pairs", "--reference",
            f"{root}/reference/checkpoints"]
    overrides = ["model.seq_length=64", "train.micro_batch_size=2", HALVES[0]]
    policy, ref = (np.load(root / f"scored_{name}.npz")["valid"] for name in ("policy", "reference"))
    kept = ~np.isnan(policy[:, 0])
    rewards = 0.1 * (policy[kept] - ref[kept])  # [pairs, 2] beta x (policy - reference), chosen and rejected
    d = rewards[:, 0] - rewards[:, 1]
    expected = {"rewards/accuracies": float((d > 0).mean()), "rewards/margins": float(d.mean()),
                "rewards/chosen": float(rewards[:, 0].mean()), "logps/rejected": float(policy[kept, 1].mean()),
                "loss": float(np.logaddexp(0, -d).mean())}  # -log sigmoid(d)
    assert kept.sum() >= 3 and 0 < expected["rewards/accuracies"] < 1, kept.sum()
    for extra in ([], ["--nproc", "2", "parallel.tp=2"]):
        got = _evaluate(*args, *extra[:2], *overrides, *extra[2:])
        assert got["pairs"] == kept.sum(), (extra, got)
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (extra, key, got[key], value)
