"""Canonical LoRA (models/lora_split.py: peft.targets linear_q, linear_k, linear_v, linear_fc1_gate, linear_fc1_up,
an A and a B per part of the fused QKV / fc1, Hugging Face PEFT's layout):

- the adapted fused linear (QKV with GQA, 2 groups a rank; SwiGLU's fc1; q + v only) at tp1, tp2, tp2 + SP and
  replicated against plain PyTorch separate q / k / v (gate / up) LoRAs: outputs and the gradients of x, A and B;
- 3 steps at tp2, tp2 + SP, pp2 and tp2 splitting only the MLP equal one process (tests/test_lora.py's
  machinery), the memory estimate's adapter count equal to the built ranks';
- the rules refuse both forms of one linear.
Against Hugging Face PEFT (different A's, import / export, a tp1 import loaded at tp2): test_lora_canonical_peft.py."""

import pytest
import torch
from harness import run_distributed
from layouts import max_rel_diff

CANONICAL = ["linear_q", "linear_k", "linear_v", "linear_proj", "linear_fc1_gate", "linear_fc1_up", "linear_fc2"]
TARGETS = f"peft.targets=[{','.join(CANONICAL)}]"


def _linears() -> list[str]:
    """Fused QKV (np 8, ng 4, hn 4: 2 query groups a rank at tp2) and SwiGLU fc1 with an adapter per part (or q
    and v only) against y_p = x W_p^T + (alpha / r) x A_p^T B_p^T per part p, computed apart and compared on
    this rank's rows of each part."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    from models.linear import ColumnParallelLinear
    from models.lora_split import add_split
    from training.parallel import dist as D

    failures, (s, b, h, heads, groups, hn, ffn, r, alpha) = [], (4, 2, 16, 8, 4, 4, 12, 3, 6.0)
    g = torch.Generator().manual_seed(0)
    rows = {"q": heads * hn, "k": groups * hn, "v": groups * hn, "gate": ffn, "up": ffn}
    x = torch.randn(s, b, h, generator=g)
    w = {p: torch.randn(n, h, generator=g) for p, n in rows.items()}
    a = {p: torch.randn(r, h, generator=g) for p in rows}  # every part its own A
    bb = {p: torch.randn(n, r, generator=g) for p, n in rows.items()}  # B nonzero
    y_grad = {p: torch.randn(s, b, n, generator=g) for p, n in rows.items()}
    try:
        for tp, sp, whole in ((1, False, False), (2, False, False), (2, True, False), (2, False, True)):
            D.init(tp=tp, timeout_minutes=2)
            rank = ps.get_tensor_model_parallel_rank()
            config = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=heads,
                                       num_query_groups=groups, kv_channels=hn, ffn_hidden_size=ffn,
                                       gated_linear_unit=True, tensor_model_parallel_size=tp, sequence_parallel=sp,
                                       use_cpu_initialization=True, perform_initialization=False)
            if whole:
                config.tensor_model_parallel_size, config.tp_replicated = 1, True
            cut = 1 if whole else tp

            def mine(t: torch.Tensor, dim: int) -> torch.Tensor:  # this rank's contiguous piece along dim
                return t.chunk(cut, dim=dim)[0 if whole else rank]

            for fused, names, adapted in (("linear_qkv", ("q", "k", "v"), ("q", "k", "v")),
                                          ("linear_qkv", ("q", "k", "v"), ("q", "v")),
                                          ("linear_fc1", ("gate", "up"), ("gate", "up"))):
                label = f"tp{tp} sp={sp} whole={whole} {fused} {'+'.join(adapted)}"
                qkv = fused == "linear_qkv"
                out = sum(rows[p] for p in names)
                layer = ColumnParallelLinear(h, out, config=config, init_method=torch.nn.init.zeros_, bias=False,
                                             gather_output=False, stride=1 if qkv else 2)
                add_split(layer, fused, tuple(f"lora_{p}" if p in adapted else None for p in names), r, alpha)
                if qkv:  # attention's layout: [ng, (np/ng) q | k | v] rows, TP cuts whole groups
                    full = torch.cat([w[p].reshape(groups, -1, h) for p in names], dim=1).flatten(0, 1)
                    local = mine(full, 0)
                else:  # [gate; up], each half cut by TP (stride 2)
                    local = torch.cat([mine(w[p], 0) for p in names])
                with torch.no_grad():
                    layer.weight.copy_(local)
                    for p in adapted:
                        getattr(layer, f"lora_{p}").lora_a.copy_(a[p])
                        getattr(layer, f"lora_{p}").lora_b.copy_(mine(bb[p], 0))
                layer.weight.requires_grad_(False)
                x_ref = x.clone().requires_grad_(True)
                a_ref = {p: a[p].clone().requires_grad_(True) for p in adapted}
                b_ref = {p: bb[p].clone().requires_grad_(True) for p in adapted}
                y_ref = {p: x_ref @ w[p].T + ((alpha / r) * (x_ref @ a_ref[p].T) @ b_ref[p].T if p in adapted else 0)
                         for p in names}  # plain PyTorch, each part apart: [s, b, rows_p]
                sum((y_ref[p] * y_grad[p]).sum() for p in names).backward()
                seq = (lambda t: t.chunk(tp, dim=0)[rank]) if sp else (lambda t: t)  # SP: the sequence split
                x_in = seq(x).clone().requires_grad_(True)
                y, _ = layer(x_in)  # [s, b, out/tp]
                if qkv:  # the fused output per local group, as attention reads it
                    width = {p: rows[p] // groups for p in names}
                    got = dict(zip(names, y.view(s, b, groups // cut, -1).split([width[p] for p in names], dim=-1)))
                    got = {p: t.flatten(2) for p, t in got.items()}
                else:
                    got = dict(zip(names, y.chunk(2, dim=-1)))
                grad = (torch.cat([mine(y_grad[p].reshape(s, b, groups, -1), 2) for p in names], dim=-1).flatten(2)
                        if qkv else torch.cat([mine(y_grad[p], 2) for p in names], dim=-1))  # this rank's, fused
                (y * grad).sum().backward()
                checks = {f"{p} output": (got[p], mine(y_ref[p], 2)) for p in names}
                checks["x grad"] = (x_in.grad, seq(x_ref.grad))
                for p in adapted:
                    part = getattr(layer, f"lora_{p}")
                    if sp:  # finalize_model_grads' sum over TP of the SP-partial A gradient
                        assert getattr(part.lora_a, "sequence_parallel", False)
                        dist.all_reduce(part.lora_a.grad, group=ps.get_tensor_model_parallel_group())
                    checks[f"A_{p} grad"] = (part.lora_a.grad, a_ref[p].grad)
                    checks[f"B_{p} grad"] = (part.lora_b.grad, mine(b_ref[p].grad, 0))
                for what, (got_t, want) in checks.items():
                    if (d := None if got_t is None else max_rel_diff(got_t, want)) is None or d > 1e-6:
                        failures.append(f"{label}: {what} off by {d}")
                if layer.weight.grad is not None:
                    failures.append(f"{label}: the frozen weight got a gradient")
            D.reset_model_parallel()
    finally:
        D.teardown()
    return failures


def test_canonical_linear_matches_plain_pytorch():
    failures = run_distributed(_linears, 2, timeout=120)
    assert failures == [[], []], failures


# ---- 3 steps at other layouts equal one process (tests/test_lora.py's machinery, canonical targets) ----------
LAYOUTS = {"tp2": ["parallel.tp=2"], "tp2-sp": ["parallel.tp=2", "parallel.sp=true"], "pp2": ["parallel.pp=2"],
           "tp2-mlp": ["parallel.tp=2", "parallel.tp_blocks=[mlp]"]}  # attention whole: its part adapters too


def _differences(label: str, got: dict, ref: dict) -> list[str]:
    from test_lora import RTOL, STEPS, TENSOR_RTOL

    out = [f"{label}: {what} at step {i + 1}: {a} vs one process {b}" for what in ("losses", "norms")
           for i, (a, b) in enumerate(zip(got[what], ref[what])) if abs(a - b) > RTOL * abs(b)]
    for name, value in ref["before"].items():  # the same seed: the same base and adapters at any layout
        if max_rel_diff(got["before"][name], value) > 1e-7:
            out.append(f"{label}: initial {name} differs from one process's")
    for name, value in ref["after"].items():
        if name.endswith(("lora_a", "lora_b")) and (d := max_rel_diff(got["after"][name], value)) > TENSOR_RTOL:
            out.append(f"{label}: {name} after {STEPS} steps differs by {d:.2e}")
        elif not name.endswith(("lora_a", "lora_b")) and not torch.equal(got["after"][name], got["before"][name]):
            out.append(f"{label}: frozen {name} changed")
    if set(got["grads"]) != set(ref["grads"]):
        out.append(f"{label}: adapter gradients {sorted(set(got['grads']) ^ set(ref['grads']))[:4]} not on both")
    out += [f"{label}: gradient of {n} differs by {d:.2e}" for n, g in got["grads"].items() if n in ref["grads"]
            and (d := max_rel_diff(g, ref["grads"][n])) > TENSOR_RTOL]
    return out


def test_canonical_layouts_equal_one_process():
    """tp2, tp2 + SP, pp2, tp2 with attention whole: 3 steps = one process's (the same seed: the same adapters
    at any layout). The memory estimate counts each rank's adapters (training/estimate/lora.py)."""
    from layouts import VOCAB, model_overrides
    from test_lora import BATCH, LORA as TRAIN, _check_rank_holdings, _gather, _train_all

    from models.shape import ModelShape
    from training.config.compose import compose
    from training.estimate.memory import estimate
    from training.parallel.layout import Layout

    def estimated(overrides: list[str], world: int) -> int:
        cfg = compose(model_overrides(*TRAIN, TARGETS, *overrides))
        return estimate(cfg, ModelShape.of(cfg.model, VOCAB), Layout.of(cfg, world)).adapters

    (ref_rank,) = [r[0] for r in run_distributed(_train_all, 1, ([[TARGETS]], BATCH), timeout=300)]
    _check_rank_holdings([ref_rank], dist_opt=False)
    assert ref_rank["adapter_numel"] == estimated([], 1), ref_rank["adapter_numel"]
    ref = _gather([ref_rank])
    adapters = [n for n in ref["after"] if n.endswith(("lora_a", "lora_b"))]
    assert len(adapters) == 4 * 7 * 2 and all(".linear_qkv.linear_" in n or ".linear_fc1.linear_fc1_" in n
                                              or ".linear_proj." in n or ".linear_fc2." in n for n in adapters)
    assert all(not torch.equal(ref["after"][n], ref["before"][n]) for n in adapters if n.endswith("lora_b"))
    per_rank = run_distributed(_train_all, 2, ([[TARGETS, *o] for o in LAYOUTS.values()], BATCH), timeout=400)
    failures = []
    for i, label in enumerate(LAYOUTS):
        ranks = [r[i] for r in per_rank]
        _check_rank_holdings(ranks, dist_opt=False)
        if {r["adapter_numel"] for r in ranks} != {want := estimated(LAYOUTS[label], 2)}:  # pp2: 2 layers a stage
            failures.append(f"{label}: adapters {[r['adapter_numel'] for r in ranks]}, the estimate says {want}")
        failures += _differences(label, _gather(ranks), ref)
    assert not failures, "\n".join(failures)



@pytest.mark.fast
def test_rules_refuse_both_forms_of_one_linear():
    from training.config.compose import compose
    from training.config.validate import problems

    assert not [p for p in problems(compose(["peft=lora", TARGETS]), 1) if "peft" in p]
    bad = problems(compose(["peft=lora", "peft.targets=[linear_qkv,linear_q,linear_fc1,linear_fc1_up]"]), 1)
    assert sum("linear_qkv" in line and "['linear_q']" in line for line in bad) == 1, bad
    assert sum("linear_fc1 " in line and "['linear_fc1_up']" in line for line in bad) == 1, bad
    gelu = problems(compose(["peft=lora", "model.activation=gelu", "peft.targets=[linear_fc1_gate]"]), 1)
    assert sum("model.activation=gelu" in line and "linear_fc1_gate" in line for line in gelu) == 1, gelu
