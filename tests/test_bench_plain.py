"""tools/bench.py's plain-PyTorch comparisons take the same steps as ours: transformers' LlamaForCausalLM
(--compare-hf) and torchtitan 0.3.0's Llama3Model (--compare; skipped when the optional bench extra is not
installed), each with torch AdamW, clipping and our schedule, from our weights: every step's loss, grad norm and
learning rate, and the weights after the updates, equal to 1e-5 (HF: the first gradients too). Then the --compare
tool end to end, and its one-line refusal when torchtitan is missing.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness import run_distributed

ROOT = Path(__file__).resolve().parents[1]
RTOL = 1e-5
VOCAB = 102  # make_vocab_size_divisible_by=1: no padded (masked) rows
TITAN = importlib.util.find_spec("torchtitan") is not None
needs_titan = pytest.mark.skipif(not TITAN, reason="torchtitan not installed (the bench extra: training/bench/"
                                                   "bench_titan.py INSTALL)")
OVERRIDES = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
             "model.ffn_hidden_size=96", "model.seq_length=16", f"model.vocab_size={VOCAB}",
             "model.make_vocab_size_divisible_by=1", "train.micro_batch_size=2", "train.global_batch_size=4",
             "checkpoint=none", "train.tensorboard=false", "optim.warmup_iters=2", "train.iters=5",
             "optim.adam_eps=1e-4"]


def _ours_and_plain(steps: int, others: list[str]) -> dict:
    """Ours and each plain side from the same weights, `steps` training steps each: losses, grad norms,
    learning rates, and the weights after (in HF names); the first step's gradients of ours and HF's."""
    from models.gpt import to_hf
    from models.shape import ModelShape
    from training.bench import bench_hf, bench_titan
    from training.bench import benchmark as bm
    from training.config.compose import compose
    from training.config.validate import validate
    from training.engine.build import build
    from training.engine.step import train_step
    from training.interop import hf
    from training.parallel import dist as D
    from training.parallel.wrap import unwrap

    cfg = compose(OVERRIDES)
    derived = validate(cfg)
    with D.distributed(timeout_minutes=2) as info:
        ours = build(cfg, ModelShape.of(cfg.model, VOCAB), info.device)
        builders = {"hf": bench_hf.build_hf, "titan": bench_titan.build_titan}
        sides = {name: builders[name](ours, cfg, info.device) for name in others}
        batch = bm.synthetic_batch(cfg, VOCAB)
        streams, micro = bm.batch_streams(ours, batch, cfg), bench_hf.micro_batches(batch, 2, info.device)
        out = {name: [] for name in ["ours", *others]}
        for _ in range(steps):
            r = train_step(ours, streams(), derived, cfg, info.device)
            out["ours"].append((r.loss, r.grad_norm, ours.optimizer.param_groups[0]["lr"]))
            out.setdefault("ours_used_lr", []).append(r.lr)  # what the log reports for this iteration
            for name, side in sides.items():
                lr = side.optimizer.param_groups[0]["lr"]  # the lr this step used (the scheduler steps after it)
                out[name].append((*bench_hf.hf_train_step(side, micro), lr))
            if "ours_grads" not in out:  # the first step's gradients, before any update
                params = dict(unwrap(ours.model[0]).named_parameters())
                out["ours_grads"] = {n: g.clone() for n, g in to_hf(lambda n: params[n].main_grad,
                                                                     ours.config, ours.shape)}
                out["hf_grads"] = {n: p.grad.clone() for n, p in sides["hf"].model.named_parameters()}
        out["ours_weights"] = {name: t.clone() for name, t in hf.hf_tensors(ours)}
        out["hf_weights"] = {n: p.detach().clone() for n, p in sides["hf"].model.named_parameters()}
        if "titan" in sides:
            out["titan_weights"] = {n: t.clone() for n, t in bench_titan.titan_state_dict_as_hf(sides["titan"]).items()}
    return out


@pytest.fixture(scope="module")
def steps():
    """4 steps of ours, HF's and (when installed) torchtitan's Llama, in one process."""
    (r,) = run_distributed(_ours_and_plain, world_size=1, args=(4, ["hf"] + (["titan"] if TITAN else [])),
                           timeout=180)
    return r


def _same_steps(r: dict, other: str) -> None:
    for step, ((loss, norm, lr), (ref_loss, ref_norm, ref_lr)) in enumerate(zip(r["ours"], r[other])):
        assert loss == pytest.approx(ref_loss, rel=RTOL), (step, r["ours"], r[other])
        assert norm == pytest.approx(ref_norm, rel=RTOL), (step, r["ours"], r[other])
    # lr of the step before the scheduler stepped it: ours reads it after, so ours[k] is other[k + 1]
    assert [lr for *_, lr in r["ours"][:-1]] == pytest.approx([lr for *_, lr in r[other][1:]], rel=1e-12)
    # the logged lr (StepResult.lr) is the one the update used: the reference's at the same step (0 at the first)
    assert r["ours_used_lr"] == pytest.approx([lr for *_, lr in r[other]], rel=1e-12)
    assert r[other][0][2] == 0.0 and r[other][2][2] > 0  # warmup starts at 0, as Megatron-Core's scheduler does
    assert len({loss for loss, *_ in r["ours"]}) == 3, "steps 2-4 must see updated weights (step 1 has lr 0)"
    # Adam divides each gradient element by its own RMS: with eps 1e-8 an element whose gradient is tiny keeps
    # its last-bit difference as an O(lr) step (measured 3.4e-5 and 1.2e-4 apart after 3 updates, by luck of
    # the rounding). eps 1e-4 (OVERRIDES, every side) keeps such elements linear: 1.1e-6 measured
    theirs = r[f"{other}_weights"]
    assert set(r["ours_weights"]) <= set(theirs), sorted(set(r["ours_weights"]) - set(theirs))
    for name, ours in r["ours_weights"].items():
        diff = (ours - theirs[name]).abs().max() / theirs[name].abs().max()
        assert diff <= RTOL, ("weight", name, float(diff))


def test_hf_llama_with_plain_adamw_takes_the_same_steps(steps):
    """--compare-hf times equal work: every step's loss, grad norm and learning rate, and the first step's
    gradients, and the weights after the updates (warmup from lr 0, then cosine decay; clipping and weight
    decay on), all equal to 1e-5."""
    _same_steps(steps, "hf")
    assert set(steps["ours_weights"]) == set(steps["hf_weights"]) == set(steps["ours_grads"]) == set(steps["hf_grads"])
    for name, ref in steps["hf_grads"].items():  # measured <= 4.5e-7
        diff = (steps["ours_grads"][name] - ref).abs().max() / ref.abs().max()
        assert diff <= RTOL, ("gradient", name, float(diff))


@needs_titan
def test_torchtitan_llama_loaded_through_its_adapter_takes_the_same_steps(steps):
    """--compare times equal work: torchtitan's model (fused QKV, complex RoPE on interleaved pairs: its adapter
    permutes Q and K) from our HF tensors computes the same losses and updates; its weights, back through its
    own to_hf, equal ours after 4 steps (tied: no lm_head of its own)."""
    _same_steps(steps, "titan")
    assert set(steps["titan_weights"]) == set(steps["ours_weights"])


@needs_titan
def test_bench_tool_compare_reports_both_ratios():
    from training.bench.report import report

    proc = subprocess.run(
        [sys.executable, "tools/bench.py", "--compare", "--json", "--threads", "1", "--warmup", "1", "--windows", "3",
         "model.num_layers=2", "model.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=4"],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for other in ("hf", "titan"):
        assert result[f"{other}_s"] > 0 and result[f"ratio_{other}"] > 0 and len(result[f"window_ratios_{other}"]) == 3
        assert result[f"loss_rel_diff_{other}"] <= RTOL
    text = report(result)
    assert "ratio ours/hf" in text and "ratio ours/titan" in text and "torchtitan 0.3.0" in text, text


def test_compare_without_torchtitan_says_how_to_install_it(monkeypatch):
    import training.bench.bench_titan as bench_titan
    from training.errors import ConfigError

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchtitan" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"--compare needs torchtitan .*pip install --no-deps -c constraints.txt "
                                          r"torchtitan==0\.3\.0"):
        bench_titan.build_titan(None, None, None)
