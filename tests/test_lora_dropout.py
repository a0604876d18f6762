"""LoRA dropout (peft.dropout > 0, models/lora.py lora_delta) at tp2, tp2 + sp, a mixture of experts at tp2 + sp
with expert TP 2 and MLA at tp2 + sp (adapters on its replicated down projections too), through
tests/lora_steps.py's 3 steps (clipping active), every adapter's dropout mask recorded.

The RNG contract is Megatron-Core's dropouts': an adapter whose input is the same on every TP rank draws from a
stream that is the same on every rank (a column adapter without SP: the default stream, so at tp2 its masks are
one process's own; an expert's fc1, whose tokens the dispatcher gathered over expert TP: the data-parallel one),
so its masks agree across the ranks; an adapter whose input is the rank's own piece (a row adapter's features, an
SP column or replicated adapter's tokens, an expert fc2's features) draws from the TP (expert: the
expert-parallel) stream, distinct per rank, so its masks differ across the ranks.

One process cannot draw those masks (the layout's two [s, b, in/2] draws from two seeds are no slicing of its one
[s, b, in] draw), so a run at a layout cannot equal one process's own dropout run. What it must equal, and does
here: one process given the layout's masks, glued into one process's shapes (own pieces side by side, replicated
ones once) and replayed in the same call order: the losses and grad norms (1e-6), the adapters after 3 steps and
their last gradients (3e-5), the frozen weights bit-identical."""

import io

import pytest
import torch
from harness import run_distributed
from layouts import max_rel_diff
from lora_steps import BATCH, RTOL, TENSOR_RTOL, _check_rank_holdings, _gather, _train
from model_options import MLA_OPTIONS

P = 0.25
DROPOUT = [f"peft.dropout={P}"]
MOE = ["model=moe_tiny", "model.moe.ffn_hidden_size=32", "model.moe.first_dense=1"]  # as test_lora_moe.py
SP = ["parallel.tp=2", "parallel.sp=true"]
# MLA: its down projections are replicated linears ("whole"), on each rank's own tokens under SP
MLA = [*MLA_OPTIONS, "peft.targets=[linear_q_down_proj,linear_q_up_proj,linear_kv_down_proj,linear_kv_up_proj,"
       "linear_proj,linear_fc1,linear_fc2]"]
LAYOUTS = {"tp2": ["parallel.tp=2"], "tp2-sp": SP, "moe-tp2-sp-etp2": [*MOE, *SP, "parallel.etp=2"],
           "mla-tp2-sp": [*MLA, *SP]}


def _train_masked(overrides: list[str], replay: list | None) -> dict:
    """lora_steps._train with models.lora's dropout watched: each call's mask recorded with where it came from
    (kind, SP, expert, TP rank and size), or (replay) the given masks applied in call order instead."""
    from megatron.core import parallel_state as ps

    import models.lora as lora

    if replay is not None:  # bytes (torch.save): tensors as arguments would travel as one fd each
        replay = torch.load(io.BytesIO(replay))
    real_delta, real_f, calls, masks = lora.Adaptable.lora_delta, lora.F, [], iter(replay or [])

    def delta(self, x):
        expert = getattr(self, "explicit_expert_comm", False)
        group = ps.get_tensor_model_parallel_group() if self.lora_kind == "whole" else self.tp_group
        size, sp = group.size(), getattr(self, "sequence_parallel", getattr(self.weight, "sequence_parallel", False))
        calls.append({"kind": self.lora_kind, "sp": sp and not expert, "expert": expert,
                      "rank": group.rank() if size > 1 else 0, "size": size})
        return real_delta(self, x)

    class Functional:  # torch.nn.functional, its dropout watched
        def __getattr__(self, name):
            return getattr(real_f, name)

        @staticmethod
        def dropout(x, p, training=True):
            if replay is not None:
                mask = next(masks)
                assert mask.shape == x.shape, (mask.shape, x.shape, calls[-1])
                return x * mask.to(x.dtype).div_(1 - p)  # as torch's CPU dropout: x * (bernoulli / (1 - p))
            y = real_f.dropout(x, p, training)
            assert bool((x != 0).all()), "a zero input would hide its mask"
            calls[-1]["mask"] = y != 0
            return y

    lora.Adaptable.lora_delta, lora.F = delta, Functional()
    try:
        out = _train([*DROPOUT, *overrides], BATCH)
    finally:
        lora.Adaptable.lora_delta, lora.F = real_delta, real_f
    if replay is not None:
        assert next(masks, None) is None, "the replay took fewer masks than the layout drew"
    return {**out, "calls": [c for c in calls if "mask" in c or replay is not None]}


def _runs(specs: list[tuple[list[str], list | None]]) -> list[dict]:
    from training.parallel import dist as D

    try:
        return [_train_masked(overrides, replay) for overrides, replay in specs]
    finally:
        D.teardown()


def _own_piece(call: dict) -> bool:  # a row's features; an SP column's or replicated linear's tokens
    return call["kind"] == "row" or (call["kind"] in ("column", "whole") and call["sp"])


def _packed(masks: list[torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save(masks, buffer)
    return buffer.getvalue()


def _glue(per_rank: list[list[dict]]) -> tuple[list[torch.Tensor], list[dict], list[str]]:
    """The layout's masks in one process's shapes (own pieces side by side: an SP column's tokens on dim 0, a
    row's features on the last; a replicated input's once), where each came from, what broke the RNG contract."""
    glued, wheres, broken = [], [], []
    for i, calls in enumerate(zip(*per_rank)):
        where = {k: v for k, v in calls[0].items() if k not in ("mask", "rank")}
        assert all({k: v for k, v in c.items() if k not in ("mask", "rank")} == where for c in calls), calls
        wheres.append(where)
        masks = [c["mask"] for c in sorted(calls, key=lambda c: c["rank"])]
        same = all(torch.equal(m, masks[0]) for m in masks)
        if _own_piece(where):
            if same and masks[0].numel():
                broken.append(f"call {i} {where}: the same mask on every TP rank's own piece")
            glued.append(torch.cat(masks, dim=-1 if where["kind"] == "row" else 0))
        else:
            if not same:
                broken.append(f"call {i} {where}: TP ranks' masks on a replicated input differ")
            glued.append(masks[0])
    return glued, wheres, broken


@pytest.fixture(scope="module")
def runs():
    per_rank = run_distributed(_runs, 2, ([(o, None) for o in LAYOUTS.values()],), timeout=300)
    layouts, glued = {}, {}
    for i, label in enumerate(LAYOUTS):
        ranks = [r[i] for r in per_rank]
        layouts[label] = ranks
        glued[label] = _glue([r.pop("calls") for r in ranks])
    specs = [([], None)] + [([o for o in overrides if not o.startswith("parallel.")], _packed(glued[label][0]))
                            for label, overrides in LAYOUTS.items()]
    (single,) = run_distributed(_runs, 1, (specs,), timeout=300)
    return {"layouts": layouts, "glued": glued, "own": single[0], "replayed": dict(zip(LAYOUTS, single[1:]))}


def test_lora_dropout_masks_follow_megatrons_rng_contract(runs):
    """Own pieces: distinct masks per TP rank; replicated inputs: one mask; at tp2 the replicated (column)
    adapters' masks are one process's own; dropout drops about P of every adapter kind's inputs."""
    for label, (masks, calls, broken) in runs["glued"].items():
        assert not broken, f"{label}:\n" + "\n".join(broken[:10])
        kinds = {(c["kind"], c["expert"]) for c in calls}
        extra = {"moe": {("column", True), ("row", True)}, "mla": {("whole", False)}}.get(label[:3], set())
        assert kinds == {("column", False), ("row", False)} | extra, (label, kinds)
        for kind in kinds:
            dropped = torch.cat([(~m).flatten() for m, c in zip(masks, calls) if (c["kind"], c["expert"]) == kind])
            assert abs(dropped.float().mean().item() - P) < 0.03, (label, kind, dropped.float().mean().item())
    own, (tp2, _, _) = runs["own"]["calls"], runs["glued"]["tp2"]
    assert [c["kind"] for c in own] == [c["kind"] for c in runs["replayed"]["tp2"]["calls"]]
    columns = [i for i, c in enumerate(own) if c["kind"] == "column"]
    assert columns and all(torch.equal(own[i]["mask"], tp2[i]) for i in columns), \
        "tp2's column adapters (the same input on both ranks) must draw one process's masks"
    rows = [i for i, c in enumerate(own) if c["kind"] == "row"]
    assert not any(torch.equal(own[i]["mask"], tp2[i]) for i in rows)  # a row's: from two TP streams


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_lora_dropout_layout_equals_one_process_with_its_masks(runs, label):
    ranks, ref = runs["layouts"][label], runs["replayed"][label]
    _check_rank_holdings(ranks, dist_opt=False)
    got, ref = _gather(ranks), _gather([ref])
    own = _gather([runs["own"]]) if label.startswith("tp2") else None
    failures = []
    for what in ("losses", "norms"):
        for step, (a, b) in enumerate(zip(got[what], ref[what])):
            if abs(a - b) > RTOL * abs(b):
                failures.append(f"{what} at step {step + 1}: {a} vs one process with its masks {b}")
    if own is not None:  # the masks matter: one process's own masks give other losses
        assert own["losses"][1:] != ref["losses"][1:], "dropout must change the run"
    adapters = [n for n in ref["after"] if n.endswith(("lora_a", "lora_b"))]
    assert adapters and set(got["grads"]) == set(adapters)
    for name in ref["after"]:
        if name not in adapters:
            if not torch.equal(got["after"][name], got["before"][name]):
                failures.append(f"frozen {name} changed")
        elif (d := max_rel_diff(got["after"][name], ref["after"][name])) > TENSOR_RTOL:
            failures.append(f"{name} after the steps differs by {d:.2e}")
    for name, grad in got["grads"].items():
        if (d := max_rel_diff(grad, ref["grads"][name])) > TENSOR_RTOL:
            failures.append(f"gradient of {name} differs by {d:.2e}")
    assert not failures, f"{label}:\n" + "\n".join(failures[:20])
