"""The one layout type (training/parallel/layout.py): validation, the planner, the memory estimate and the
distributed init agree on dp, edp and every divisor, over a grid of layouts and world sizes."""

import dataclasses
import importlib.util
import itertools

import pytest
from conftest import ROOT
from harness import run_distributed

from models.shape import ModelShape
from training.config.compose import compose
from training.config.validate import problems, validate
from training.errors import ConfigError
from training.estimate.memory import estimate
from training.parallel.layout import Layout

MOE = ["model=moe_tiny"]


def _plan_module():
    spec = importlib.util.spec_from_file_location("plan_tool", ROOT / "tools" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _grid():
    """Configs for tp, pp, vpp, cp, ep, fsdp over worlds 1..8 (the valid and the invalid), with their world."""
    base = {moe: compose([*(MOE * moe), "model.seq_length=256", "train.global_batch_size=32",
                          "train.micro_batch_size=2"]) for moe in (False, True)}
    for world, tp, pp, cp in itertools.product((1, 2, 4, 8), (1, 2), (1, 2), (1, 2)):
        for vpp, ep, fsdp in itertools.product((None, 2), (1, 2), ("none", "optim_grads_params")):
            sp = tp > 1 and (ep > 1 or cp == 1)  # MoE under TP needs SP; also try SP without CP
            cfg = base[ep > 1]
            parallel = dataclasses.replace(cfg.parallel, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, sp=sp, fsdp=fsdp,
                                           dist_opt=fsdp != "none")  # as schema.to_config sets it
            yield dataclasses.replace(cfg, parallel=parallel), world


@pytest.mark.fast
def test_validation_planner_and_estimate_read_one_layout():
    plan = _plan_module()
    valid = 0
    for cfg, world in _grid():
        p = cfg.parallel
        if problems(cfg, world):
            continue
        valid += 1
        layout = validate(cfg, world)
        assert layout == Layout.of(cfg, world)
        assert layout.dp * p.tp * p.pp * p.cp == world and layout.edp * p.pp * p.ep * p.etp == world
        assert layout.num_microbatches * layout.dp * cfg.train.micro_batch_size == cfg.train.global_batch_size
        assert cfg.model.seq_length % layout.seq_divisor == 0
        # the planner, asked for this world, lists this very layout (it skips sharding over one rank)
        planned = {lay for lay, _ in plan.candidates(cfg, world, gpus_per_node=p.tp)[0]}
        assert layout in planned or layout.fsdp_enabled and layout.dp == 1, (layout.name, world)
        assert estimate(cfg, ModelShape.of(cfg.model, 257), layout).layout == layout
    assert valid >= 40, valid


@pytest.mark.fast
def test_divisors_are_the_layouts():
    """The sequence divisor (2 cp chunks, then SP over tp) and the layer divisor (pp x vpp) decide exactly."""
    for tp, cp, sp in [(2, 1, True), (1, 2, False), (2, 2, True), (2, 2, False)]:
        layout = Layout(tp * cp, tp=tp, cp=cp, sp=sp)
        base = [f"parallel.tp={tp}", f"parallel.cp={cp}", f"parallel.sp={str(sp).lower()}"]
        validate(compose([*base, f"model.seq_length={8 * layout.seq_divisor}"]), layout.world)
        with pytest.raises(ConfigError, match=f"model.seq_length={8 * layout.seq_divisor + 1}"):
            validate(compose([*base, f"model.seq_length={8 * layout.seq_divisor + 1}"]), layout.world)
    layout = Layout(2, pp=2, vpp=2)
    validate(compose(["parallel.pp=2", "parallel.vpp=2", f"model.num_layers={layout.chunks}"]), 2)
    with pytest.raises(ConfigError, match=r"parallel.pp \* vpp = 2 \* 2 = 4"):
        validate(compose(["parallel.pp=2", "parallel.vpp=2", "model.num_layers=6"]), 2)


@pytest.mark.fast
def test_names_and_overrides_round_trip():
    for name in ["single", "tp2", "dp2", "tp2pp2", "pp2vpp2", "tp2cp2sp", "ep2dp2", "tp2ep2dp2sp", "dp2distopt",
                 "dp2zero3", "tp2dp2zero2", "pp2ep2dp2"]:
        layout = Layout.from_name(name)
        assert layout.name == name
        cfg = compose(["model=moe_tiny"] * layout.ep_enabled + layout.overrides())
        parsed = dataclasses.replace(Layout.of(cfg, layout.world), micro_batch_size=1, global_batch_size=0)
        assert parsed == layout, name
    assert Layout.from_name("tp2dp2").world == 4 and Layout.from_name("ep2dp2").world == 2
    with pytest.raises(ConfigError, match="cannot read 'x3'"):
        Layout.from_name("tp2x3")


def _init_agrees(layouts: list[Layout]) -> list[tuple]:
    """Megatron-Core's groups for each layout on these 4 processes, next to what the Layout says."""
    from megatron.core import parallel_state as ps

    from training.parallel import dist as D

    out = []
    for layout in layouts:
        info = D.init(tp=layout.tp, pp=layout.pp, vpp=layout.vpp, cp=layout.cp, ep=layout.ep, etp=layout.etp,
                      timeout_minutes=2)
        out.append((info.layout == Layout(4, layout.tp, layout.pp, layout.vpp, layout.cp, layout.ep, layout.etp),
                    ps.get_data_parallel_world_size(), layout.dp,
                    ps.get_expert_data_parallel_world_size(), layout.edp,
                    ps.get_context_parallel_world_size(), layout.cp,
                    ps.get_data_parallel_world_size(with_context_parallel=True), layout.grad_group,
                    (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())))
        D.reset_model_parallel()
    D.teardown()
    return out


def test_distributed_init_agrees_with_the_layout():
    layouts = [Layout.from_name(n) for n in ("tp2pp2", "dp4", "tp2dp2", "pp2ep2dp2", "tp2ep2dp2sp", "cp2dp2",
                                             "tp2cp2")]
    results = run_distributed(_init_agrees, 4, (layouts,), timeout=240)
    for rank_results in results:
        for layout, (same, dp, want_dp, edp, want_edp, cp, want_cp, grad, want_grad, _) in zip(layouts, rank_results):
            assert same and (dp, edp, cp, grad) == (want_dp, want_edp, want_cp, want_grad), layout.name
    # tp2pp2: every (tp rank, pp rank) pair once
    assert sorted(r[0][-1] for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
