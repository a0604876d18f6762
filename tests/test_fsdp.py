"""Megatron-FSDP (parallel.fsdp): ZeRO-2 and ZeRO-3 train what one process trains, resume exactly, reshard over
DP, refuse the other checkpoint format in one line, and hold the memory the estimate says.

The layouts load the single-process reference's weights, train 4 steps (warmup off: every step updates) and
are compared, fp32, max|diff| / max|ref| <= 1e-5: every step's loss, the logits and the parameters after 3
updates (Megatron-FSDP's sharded DTensors gathered back, tests/layouts.py). bf16 against a bf16 reference
within verify_layouts' band (1e-3). Under TP the parameters are compared with DDP at the same TP layout:
TP's reduction order alone moves some weights by ~1e-4 of their scale after 3 Adam updates (Adam's
normalised step amplifies last-bit gradient differences; measured 1.16e-4 with plain DDP). Megatron-FSDP's
reduce-scatter sums in yet another order: within 2.4e-5 of DDP's TP weights (ZeRO-3 + SP; held to 5e-5),
while every loss still equals one process's to 1e-5.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from layouts import make_batch, max_rel_diff, model_overrides, run_layouts
from runs import QUICK, train, train_catching

ROOT = Path(__file__).resolve().parents[1]
RTOL, BF16_RTOL, STEPS = 1e-5, 1e-3, 4
NO_WARMUP = ["optim.warmup_iters=0", "train.micro_batch_size=1", "optim.adam_eps=1e-4"]  # eps: the update follows the gradient
TP2_SP = ["parallel.tp=2", "parallel.sp=true"]
CASES = {  # name: (overrides, processes, the DDP layout whose parameters it must equal, or None: one process's)
    "zero3-dp2": (["parallel.fsdp=optim_grads_params"], 2, None),
    "zero2-dp2": (["parallel.fsdp=optim_grads"], 2, None),
    "zero3-bf16-dp2": (["parallel.fsdp=optim_grads_params", "train.precision=bf16"], 2, None),
    "zero3-tp2-sp-dp2": (["parallel.fsdp=optim_grads_params", *TP2_SP], 4, TP2_SP),
    "zero2-tp2-dp2": (["parallel.fsdp=optim_grads", "parallel.tp=2"], 4, ["parallel.tp=2"]),
}
FAST = {"zero3-dp2"}
BATCH = make_batch(global_batch=4, seq=16)


@pytest.fixture(scope="module")
def runs(request):
    items = [item for item in request.session.items if item.module is request.module]
    selected = {item.callspec.params["case"] for item in items if hasattr(item, "callspec") and
                "case" in item.callspec.params}
    precisions = sorted({"bf16" if "bf16" in name else "fp32" for name in selected})
    refs = dict(zip(precisions, run_layouts([(model_overrides(*NO_WARMUP, f"train.precision={p}"), None, STEPS, True)
                                             for p in precisions], 1, BATCH)))
    cases = {}
    for world in sorted({CASES[n][1] for n in selected}):
        names = [n for n in CASES if n in selected and CASES[n][1] == world]
        ddp = [n for n in names if CASES[n][2] is not None]  # each TP case's DDP twin rides along
        specs = [(model_overrides(*NO_WARMUP, *CASES[n][0]), refs["bf16" if "bf16" in n else "fp32"]["params_before"],
                  STEPS, True) for n in names]
        specs += [(model_overrides(*NO_WARMUP, *CASES[n][2]), refs["fp32"]["params_before"], STEPS, False)
                  for n in ddp]
        # every layout of this world size in one process group (the ranks that used to die here, SIGSEGV in
        # ~1 of 6 runs, were gloo writing into freed buckets: cpu_compat patch 8)
        cases.update(zip(names + [f"ddp:{n}" for n in ddp], run_layouts(specs, world, BATCH)))
    return refs, cases


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.fast) if c in FAST else c for c in CASES])
def test_fsdp_matches_single_process(case, runs):
    refs, cases = runs
    ref, out = refs["bf16" if "bf16" in case else "fp32"], cases[case]
    for result in (ref, out):
        if isinstance(result, Exception):
            raise result
    rtol = BF16_RTOL if "bf16" in case else RTOL
    assert out["losses"] == pytest.approx(ref["losses"], rel=rtol)
    assert len(set(ref["losses"])) == STEPS, "every step must update the weights"
    assert max_rel_diff(out["logits"], ref["logits"]) <= (0.02 if "bf16" in case else RTOL)
    if "bf16" not in case:  # bf16 weights round differently after updates: the losses carry the check
        params = ref["params"] if CASES[case][2] is None else cases[f"ddp:{case}"]["params"]
        if isinstance(params, Exception):
            raise params
        tol = RTOL if CASES[case][2] is None else 5e-5
        bad = {n: d for n, p in params.items() if not (d := max_rel_diff(out["params"][n], p)) <= tol}
        assert not bad, f"parameters after {STEPS - 1} updates differ: {bad}"
        assert all(max_rel_diff(p, ref["params_before"][n]) > 0 for n, p in ref["params"].items())


SAVE_AT_3 = ["train.iters=6", "train.save_interval=3", "checkpoint.keep=0", "train.micro_batch_size=1"]


def test_fsdp_resumes_exactly_reshards_over_dp_and_refuses_the_other_format(tmp_path):
    zero3 = ["parallel.fsdp=optim_grads_params", "train.eval_interval=3", "train.eval_iters=1"]
    full = train(SAVE_AT_3 + zero3, 2, tmp_path / "full")
    ckpt = tmp_path / "full" / "checkpoints" / "iter_0000003"
    assert json.loads((ckpt / "metadata.json").read_text())["sharded_backend"] == "fsdp_dtensor"
    resumed = train(SAVE_AT_3 + zero3 + [f"checkpoint.load={ckpt}"], 2, tmp_path / "resumed")
    assert sorted(resumed) == [4, 5, 6] and resumed == {i: full[i] for i in resumed}  # bit for bit
    # one process, ZeRO-2: DCP reshards the DTensors by their offsets; Adam's moments come along
    one = train(SAVE_AT_3 + ["parallel.fsdp=optim_grads", f"checkpoint.load={ckpt}"], 1, tmp_path / "one")
    assert one == pytest.approx({i: full[i] for i in one}, rel=RTOL)

    (ddp,) = run_distributed(train_catching, 1, (QUICK + SAVE_AT_3 + [f"checkpoint.load={ckpt}"],
                                                  str(tmp_path / "ddp")), timeout=300)
    assert ddp.startswith(f"error: checkpoint {ckpt} was saved with parallel.fsdp=optim_grads_params but this run "
                          f"has parallel.fsdp=none") and "\n" not in ddp

    # Its weights without FSDP (tp 1, pp 1): evaluate.py on one plain process scores the checkpoint as the
    # ZeRO-3 DP2 run scored itself at iteration 3, and the Hugging Face export's logits equal our model's
    records = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    (logged,) = [r["val_loss"] for r in records if "val_loss" in r and r["iteration"] == 3]
    proc = subprocess.run([sys.executable, "tools/evaluate.py", "--json", "--ckpt", str(ckpt)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["loss"] == pytest.approx(logged, rel=RTOL)
    proc = subprocess.run([sys.executable, "tools/convert_hf.py", "export", "--ckpt", str(ckpt), "--out",
                           str(tmp_path / "hf"), "--check"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "iteration 3" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    train(["train.iters=1", "checkpoint.keep=0"], 1, tmp_path / "plain")  # a DDP checkpoint
    plain = tmp_path / "plain" / "checkpoints" / "iter_0000001"
    (fsdp,) = run_distributed(train_catching, 1, (QUICK + SAVE_AT_3 + zero3 + [f"checkpoint.load={plain}"],
                                                   str(tmp_path / "fsdp")), timeout=300)
    assert fsdp.startswith(f"error: checkpoint {plain} was saved with parallel.fsdp=none but this run has "
                           f"parallel.fsdp=optim_grads_params") and "\n" not in fsdp


def _state_bytes(overrides: list[str], vocab_size: int) -> int:
    """This rank's bytes of parameters, gradient buffers and optimizer state after one step, each storage once
    (training/bench/measure.py: DDP's buffers, or Megatron-FSDP's sharded buffers and DTensor shards)."""
    from models.shape import ModelShape
    from training.bench.measure import state_bytes
    from training.config.compose import compose
    from training.config.validate import validate
    from training.data.streams import micro_batch_streams
    from training.engine.build import build
    from training.engine.step import train_step
    from training.parallel import dist as D

    cfg = compose(overrides)
    derived = validate(cfg)
    with D.distributed(**{**D.layout_of(cfg), "timeout_minutes": 2}) as info:
        state = build(cfg, ModelShape.of(cfg.model, vocab_size), info.device)
        text = torch.randint(0, vocab_size, (cfg.train.global_batch_size, cfg.model.seq_length + 1),
                             generator=torch.Generator().manual_seed(0))
        batch = [{"tokens": r[:-1], "labels": r[1:], "loss_mask": torch.ones(cfg.model.seq_length)} for r in text]
        train_step(state, micro_batch_streams(1, batch, 0, cfg.train.micro_batch_size), derived, cfg, info.device)
        return state_bytes(state)


def test_fsdp_memory_per_rank_matches_the_estimate():
    from models.shape import ModelShape
    from training.config.compose import compose
    from training.estimate.memory import estimate
    from training.parallel.layout import Layout

    base = ["model=tiny", "train.precision=bf16", "train.micro_batch_size=2", "train.global_batch_size=4",
            "checkpoint=none", "train.tensorboard=false"]
    measured = {}
    for fsdp in ("none", "optim_grads", "optim_grads_params"):
        overrides = base + [f"parallel.fsdp={fsdp}"]
        got = run_distributed(_state_bytes, 2, (overrides, 257), timeout=300)
        cfg = compose(overrides)
        lay = Layout.of(cfg, 2)
        expected = estimate(cfg, ModelShape.of(cfg.model, 257), lay).weights_and_optimizer
        for rank_bytes in got:
            assert abs(rank_bytes - expected) <= 0.1 * rank_bytes, (fsdp, rank_bytes, expected)
        measured[fsdp] = max(got)
    print(f"\nper-rank bytes at DP2, bf16: {measured}")
    assert measured["optim_grads"] < 0.6 * measured["none"]  # ZeRO-2: 10 of DDP's 18 bytes per parameter
    assert measured["optim_grads_params"] <= 0.55 * measured["none"]  # ZeRO-3: 9 of 18, + the root unit
