"""LoRA (peft=lora, models/lora.py, training/parallel/peft.py): the adapted linear against plain PyTorch, and LoRA
training at tp2, tp2+sp, pp2, pp2+vpp2, cp2, dp2 with the distributed optimizer and tp2 splitting only the MLP
(parallel.tp_blocks) against one process, each from its own initialisation with the same seed (so the adapters'
initial values are compared across layouts too): the losses and grad norms per step, the adapters after the steps and
their last gradients, the frozen weights bit-identical to their start, and the optimizer and DDP's gradient buffers
holding the adapters only."""

import pytest
import torch
from harness import run_distributed
from layouts import max_rel_diff
# the layout-equivalence machinery (test_lora_canonical.py imports these names from here too)
from lora_steps import BATCH, LORA, RTOL, STEPS, TENSOR_RTOL, _check_rank_holdings, _gather, _train_all  # noqa: F401

LAYOUTS = {"tp2": ["parallel.tp=2"], "tp2-sp": ["parallel.tp=2", "parallel.sp=true"], "pp2": ["parallel.pp=2"],
           "dp2-distopt": ["parallel.dist_opt=true", "train.micro_batch_size=1"],
           "tp2-mlp": ["parallel.tp=2", "parallel.tp_blocks=[mlp]"],  # attention whole: its adapters replicated
           "pp2-vpp2": ["parallel.pp=2", "parallel.vpp=2", "train.micro_batch_size=1"], "cp2": ["parallel.cp=2"]}
BF16 = ["parallel.tp=2", "train.precision=bf16", "model.fused_kernels=false"]  # trains, base untouched; not exact


def test_lora_layouts_equal_one_process():
    (ref_rank,) = [r[0] for r in run_distributed(_train_all, 1, ([[]], BATCH), timeout=300)]
    _check_rank_holdings([ref_rank], dist_opt=False)
    ref = _gather([ref_rank])
    adapters = [n for n in ref["after"] if n.endswith(("lora_a", "lora_b"))]
    # 4 layers x 4 targets x (A, B); B starts at zero and moves: the adapters train, the base does not
    assert len(adapters) == 32 and all(ref["before"][n].abs().sum() == 0 for n in adapters if n.endswith("lora_b"))
    frozen = [n for n in ref["after"] if n not in adapters]
    assert frozen and all(torch.equal(ref["after"][n], ref["before"][n]) for n in frozen)
    assert all(not torch.equal(ref["after"][n], ref["before"][n]) for n in adapters if n.endswith("lora_b"))
    assert any(not torch.equal(ref["after"][n], ref["before"][n]) for n in adapters if n.endswith("lora_a"))
    assert all(n > 0.1 for n in ref["norms"]), f"clipping (optim.clip_grad=0.1) must be active: {ref['norms']}"

    per_rank = run_distributed(_train_all, 2, ([*LAYOUTS.values(), BF16], BATCH), timeout=300)
    failures, bf16 = [], [r[-1] for r in per_rank]
    _check_rank_holdings(bf16, dist_opt=False)
    got = _gather(bf16)
    assert got["losses"] == pytest.approx(ref["losses"], rel=2e-2), (got["losses"], ref["losses"])
    assert got["losses"][-1] < got["losses"][0]
    assert all(torch.equal(got["after"][n], got["before"][n]) for n in frozen)
    for i, (label, overrides) in enumerate(LAYOUTS.items()):
        ranks = [r[i] for r in per_rank]
        _check_rank_holdings(ranks, dist_opt="parallel.dist_opt=true" in overrides)
        got = _gather(ranks)
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            if abs(a - b) > RTOL * abs(b):
                failures.append(f"{label}: loss at step {step + 1}: {a} vs one process {b}")
        for step, (a, b) in enumerate(zip(got["norms"], ref["norms"])):
            if abs(a - b) > RTOL * abs(b):
                failures.append(f"{label}: grad norm at step {step + 1}: {a} vs one process {b}")
        for name, value in ref["before"].items():  # the same seed: the same base and adapters at any layout
            if not torch.equal(got["before"][name], value) and max_rel_diff(got["before"][name], value) > 1e-7:
                failures.append(f"{label}: initial {name} differs from one process's")
        for name in ref["after"]:
            if name in adapters:
                if (d := max_rel_diff(got["after"][name], ref["after"][name])) > TENSOR_RTOL:
                    failures.append(f"{label}: {name} after {STEPS} steps differs by {d:.2e}")
            elif not torch.equal(got["after"][name], got["before"][name]):
                failures.append(f"{label}: frozen {name} changed")
        for name, grad in got["grads"].items():
            if (d := max_rel_diff(grad, ref["grads"][name])) > TENSOR_RTOL:
                failures.append(f"{label}: gradient of {name} differs by {d:.2e}")
        if "parallel.dist_opt=true" not in overrides and len(got["grads"]) != len(adapters):
            failures.append(f"{label}: {len(got['grads'])} adapter gradients, expected {len(adapters)}")
    assert not failures, "\n".join(failures)


def _linears() -> list[str]:
    """Every adapted linear kind at tp1, tp2 and tp2 + SP (and a replicated one at tp2) against plain PyTorch:
    y = x W^T + (alpha / r) x A^T B^T, its output and the gradients of x, A and B; W stays without a gradient."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    from models.linear import ColumnParallelLinear, RowParallelLinear
    from training.parallel import dist as D

    failures, (s, b, small, big, r, alpha) = [], (4, 2, 8, 12, 3, 6.0)
    g = torch.Generator().manual_seed(0)
    full = {k: torch.randn(*shape, generator=g) for k, shape in
            (("x_col", (s, b, small)), ("w_col", (big, small)), ("x_row", (s, b, big)), ("w_row", (small, big)))}
    try:
        for tp, sp, whole in ((1, False, False), (2, False, False), (2, True, False), (2, False, True)):
            D.init(tp=tp, timeout_minutes=2)
            rank = ps.get_tensor_model_parallel_rank()
            config = TransformerConfig(num_layers=1, hidden_size=small, num_attention_heads=2,
                                       tensor_model_parallel_size=tp, sequence_parallel=sp,
                                       use_cpu_initialization=True, perform_initialization=False)
            if whole:
                config.tensor_model_parallel_size, config.tp_replicated = 1, True
            for kind, cls, (n_in, n_out) in (("column", ColumnParallelLinear, (small, big)),
                                            ("row", RowParallelLinear, (big, small))):
                kwargs = {"gather_output": False} if kind == "column" else {"input_is_parallel": True,
                                                                           "skip_bias_add": True}
                layer = cls(n_in, n_out, config=config, init_method=torch.nn.init.zeros_, bias=False, **kwargs)
                layer.add_lora(r, alpha)
                x, w = full[f"x_{kind[:3]}"], full[f"w_{kind[:3]}"]
                a, bb = torch.randn(r, n_in, generator=g), torch.randn(n_out, r, generator=g)  # B nonzero
                y_grad = torch.randn(s, b, n_out, generator=g)

                def mine(t: torch.Tensor, dim: int) -> torch.Tensor:  # this rank's piece along dim
                    return t if whole or tp == 1 else t.chunk(tp, dim=dim)[rank]

                split_out, split_in = (mine, lambda t, d: t) if kind == "column" else (lambda t, d: t, mine)
                with torch.no_grad():
                    layer.weight.copy_(split_out(split_in(w, 1), 0))
                    layer.lora_a.copy_(split_in(a, 1))
                    layer.lora_b.copy_(split_out(bb, 0))
                layer.weight.requires_grad_(False)
                x_ref = x.clone().requires_grad_(True)
                a_ref, b_ref = a.clone().requires_grad_(True), bb.clone().requires_grad_(True)
                y_ref = x_ref @ w.T + (alpha / r) * (x_ref @ a_ref.T) @ b_ref.T  # plain PyTorch: [s, b, out]
                (y_ref * y_grad).sum().backward()
                seq = (lambda t: mine(t, 0)) if sp else (lambda t: t)  # SP: the sequence dim is split outside
                x_in = (seq(x) if kind == "column" else split_in(x, 2)).clone().requires_grad_(True)
                y, _ = layer(x_in)
                y_mine = split_out(y_ref, 2) if kind == "column" else seq(y_ref)
                (y * (split_out(y_grad, 2) if kind == "column" else seq(y_grad))).sum().backward()
                for p in (layer.lora_a, layer.lora_b):  # finalize_model_grads' SP sum over TP
                    if sp and getattr(p, "sequence_parallel", False):
                        dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
                checks = {"output": (y, y_mine),
                          "x grad": (x_in.grad, seq(x_ref.grad) if kind == "column" else split_in(x_ref.grad, 2)),
                          "A grad": (layer.lora_a.grad, split_in(a_ref.grad, 1)),
                          "B grad": (layer.lora_b.grad, split_out(b_ref.grad, 0))}
                for what, (got, want) in checks.items():
                    if max_rel_diff(got, want) > 1e-6:
                        failures.append(f"tp{tp} sp={sp} whole={whole} {kind}: {what} off by {max_rel_diff(got, want)}")
                if layer.weight.grad is not None:
                    failures.append(f"tp{tp} {kind}: the frozen weight got a gradient")
            D.reset_model_parallel()
    finally:
        D.teardown()
    return failures


def test_lora_linear_matches_plain_pytorch():
    failures = run_distributed(_linears, 2, timeout=120)
    assert failures == [[], []], failures


@pytest.mark.fast
def test_lora_rules_and_targets():
    """peft's rules, one line each, before any process; a target that names no linear, after the build."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from models.linear import ColumnParallelLinear, RowParallelLinear
    from training.config.compose import compose
    from training.config.validate import problems
    from training.errors import ConfigError
    from training.parallel import peft

    assert not [p for p in problems(compose(["peft=lora"]), 1) if "peft" in p]
    bad = problems(compose(["peft=lora", "peft.rank=0", "peft.alpha=0", "peft.dropout=1.0", "peft.targets=[]",
                            "parallel.fsdp=optim_grads", "model.compile=true"]), 1)
    for key in ("peft.rank=0", "peft.alpha=0", "peft.dropout=1.0", "peft.targets=[]", "parallel.fsdp=optim_grads",
                "model.compile=true"):
        assert sum(key in line for line in bad) == 1, (key, bad)
    assert not [p for p in problems(compose(["peft=lora", "model=moe_tiny"]), 1) if "peft" in p]  # experts adapt
    moe = problems(compose(["peft=lora", "model=moe_tiny", "model.moe.shared_expert_ffn_hidden_size=64",
                            "peft.targets=[linear_fc1_gate]"]), 1)
    for key in ("shared_expert_ffn_hidden_size=64", "['linear_fc1_gate']"):  # no adapters there yet
        assert sum(key in line for line in moe) == 1, (key, moe)
    assert not [p for p in problems(compose(["peft.rank=0"]), 1) if "peft" in p]  # peft=none: not read

    # a custom block's linears are adaptable by their own names (whole: no process group needed)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
    config.tp_replicated = True
    block = torch.nn.ModuleDict({"gate": ColumnParallelLinear(8, 16, config=config, init_method=torch.nn.init.zeros_,
                                                              bias=False, gather_output=False),
                                 "down": RowParallelLinear(16, 8, config=config, init_method=torch.nn.init.zeros_,
                                                           bias=False, input_is_parallel=True, skip_bias_add=True)})
    cfg = compose(["peft=lora", "peft.targets=[gate,up]"])
    with pytest.raises(ConfigError, match=r"\['up'\] name no linear of this model; its linears are \['down', 'gate'\]"):
        peft.adapt(cfg, [block])
    assert block["gate"].lora_a.shape == (8, 8) and block["gate"].lora_b.abs().sum() == 0


def _fine_tunes_from_a_base(run_dir: str) -> tuple[dict, dict]:
    """A base run (no adapters) saves; then a full fine-tune and a LoRA fine-tune start from it: the losses of
    their first iterations (fresh data order, the same batches)."""
    from pathlib import Path

    from runs import QUICK, _train, losses

    _train([*QUICK, "train.iters=2"], f"{run_dir}/base")
    ckpt = f"{run_dir}/base/checkpoints"
    tune = [*QUICK, "train.iters=1", f"checkpoint.load={ckpt}", "checkpoint.finetune=true", "checkpoint.dir=null"]
    _train(tune, f"{run_dir}/full")
    _train([*tune, "peft=lora"], f"{run_dir}/lora")
    return losses(Path(f"{run_dir}/full")), losses(Path(f"{run_dir}/lora"))


def test_lora_fine_tunes_a_checkpoint_without_adapters(tmp_path):
    """peft=lora with checkpoint.finetune from a base checkpoint (an import, a pretraining run: no adapter keys)
    loads the base and draws fresh adapters (B = 0): its first loss is the full fine-tune's, on the same weights
    and batches (the load once failed: the adapters' keys were looked for in the base checkpoint)."""
    full, lora = run_distributed(_fine_tunes_from_a_base, 1, (str(tmp_path),), timeout=300)[0]
    assert full[1] == pytest.approx(lora[1], rel=1e-6), (full, lora)
