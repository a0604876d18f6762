"""LoRA on a mixture of experts (models/moe.py's experts are models/linear.py's linears, models/lora.py adapts them):
each expert's adapted forward and its adapters' gradients against plain PyTorch, and LoRA training of moe_tiny
(every expert's fc1 and fc2 adapted, a dense first layer's too) at ep2 (DDP, and the distributed optimizer), tp2 +
sp with expert TP 2, ep2 x tp2 + sp with expert TP 2 and with expert TP 1 against one process, through
tests/lora_steps.py's machinery: from a fresh start with the same seed, the initial adapters, the losses and grad
norms of 3 steps (clipping active), the adapters after them and their last gradients; every frozen weight (the
router too) bit-identical to its start; DDP's expert buffers holding exactly the experts' adapters. And an
adapters-only checkpoint saved at ep2 resumes at one process and exports merged (export --adapter refused)."""

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from layouts import make_batch, max_rel_diff
from lora_steps import LORA, RTOL, STEPS, TENSOR_RTOL, _check_rank_holdings, _gather, _train_all

# moe_tiny at the test model's sizes (hidden 64, 4 layers), experts 32 wide; layer 0 dense (its MLP adapted too)
MOE = ["model=moe_tiny", "model.moe.ffn_hidden_size=32", "model.moe.first_dense=1"]
SP = ["parallel.tp=2", "parallel.sp=true"]  # MoE under TP needs SP
DIST_OPT = ["parallel.dist_opt=true", "parallel.overlap_grad_reduce=true"]  # a chain: dense + expert dist-opt
LAYOUTS = {2: {"ep2": ["parallel.ep=2"], "tp2-sp-etp2": [*SP, "parallel.etp=2"],  # processes -> cases
               "ep2-distopt": ["parallel.ep=2", *DIST_OPT]},
           4: {"ep2-tp2-sp-etp2": ["parallel.ep=2", *SP, "parallel.etp=2"], "ep2-tp2-sp": ["parallel.ep=2", *SP]}}
BATCH = make_batch(global_batch=4, seq=16)


def _estimated_adapters(overrides: list[str], world: int) -> int:
    """training/estimate/lora.py's adapter elements on one GPU of this layout (pp 1: every GPU alike)."""
    from layouts import VOCAB, model_overrides

    from models.shape import ModelShape
    from training.config.compose import compose
    from training.estimate import lora
    from training.estimate.memory import split_of
    from training.parallel.layout import Layout

    cfg = compose(model_overrides(*LORA, *MOE, *overrides))
    lay = Layout.of(cfg, world)
    return lora.adapter_params(cfg, ModelShape.of(cfg.model, VOCAB), lay, 0, split_of(lay))


def test_lora_on_experts_at_ep_and_etp_layouts_equals_one_process():
    (ref_rank,) = [r[0] for r in run_distributed(_train_all, 1, ([MOE], BATCH), timeout=300)]
    _check_rank_holdings([ref_rank], dist_opt=False)
    assert ref_rank["adapter_numel"] == _estimated_adapters([], 1)
    ref = _gather([ref_rank])
    adapters = [n for n in ref["after"] if n.endswith(("lora_a", "lora_b"))]
    experts = [n for n in adapters if ".local_experts." in n]
    # 3 MoE layers x 8 experts x (fc1, fc2) x (A, B) and the dense layer's fc1 / fc2; attention's 4 x 2 x 2
    assert len(experts) == 96 and len(adapters) == 96 + 4 + 16, len(adapters)
    assert all(not torch.equal(ref["after"][n], ref["before"][n]) for n in experts if n.endswith("lora_b"))
    frozen = [n for n in ref["after"] if n not in adapters]
    assert [n for n in frozen if n.endswith("router.weight")] and \
        all(torch.equal(ref["after"][n], ref["before"][n]) for n in frozen)
    assert all(n > 0.1 for n in ref["norms"]), f"clipping (optim.clip_grad=0.1) must be active: {ref['norms']}"

    failures, runs = [], {}
    for world, cases in LAYOUTS.items():
        per_rank = run_distributed(_train_all, world, ([[*MOE, *o] for o in cases.values()], BATCH), timeout=300)
        runs.update({label: [r[i] for r in per_rank] for i, label in enumerate(cases)})
        for label, overrides in cases.items():  # the memory estimate counts each GPU's adapters (experts' too)
            assert {r["adapter_numel"] for r in runs[label]} == {_estimated_adapters(overrides, world)}, label
    for label, ranks in runs.items():
        if "distopt" in label:  # the optimizer holds shards (its expert part over expert DP): DDP's buffers only
            assert all(r["ddp_numel"] + r["expert_ddp_numel"] == r["adapter_numel"] and r["expert_ddp_numel"] ==
                       r["expert_adapter_numel"] > 0 for r in ranks), label
        else:
            _check_rank_holdings(ranks, dist_opt=False)
        got = _gather(ranks)
        for what in ("losses", "norms"):
            for step, (a, b) in enumerate(zip(got[what], ref[what])):
                if abs(a - b) > RTOL * abs(b):
                    failures.append(f"{label}: {what} at step {step + 1}: {a} vs one process {b}")
        for name, value in ref["before"].items():  # drawn by name: the same experts' adapters at any layout
            if max_rel_diff(got["before"][name], value) > 1e-7:
                failures.append(f"{label}: initial {name} differs from one process's")
        for name in ref["after"]:
            if name not in adapters and not torch.equal(got["after"][name], got["before"][name]):
                failures.append(f"{label}: frozen {name} changed")
            elif name in adapters and (d := max_rel_diff(got["after"][name], ref["after"][name])) > TENSOR_RTOL:
                failures.append(f"{label}: {name} after {STEPS} steps differs by {d:.2e}")
        assert set(got["grads"]) == (set() if "distopt" in label else set(adapters)), label
        for name, grad in got["grads"].items():
            if (d := max_rel_diff(grad, ref["grads"][name])) > TENSOR_RTOL:
                failures.append(f"{label}: gradient of {name} differs by {d:.2e}")
    assert not failures, "\n".join(failures[:20])


@pytest.mark.fast
def test_expert_adapters_match_plain_pytorch(one_process):
    """One MoE block (4 experts, top 2, SwiGLU), every expert's fc1 and fc2 adapted with B nonzero: its output is
    sum over a token's experts j of p_j * swiglu(x (W1_j + s B1_j A1_j)^T) (W2_j + s B2_j A2_j)^T (the routing
    taken from the block's router), and each expert's A and B gradients are plain autograd's on that formula."""
    from models.lora import add_adapters
    from models.moe import MoE
    from models.shape import ModelShape
    from training.config.compose import compose
    from training.engine.bridge import transformer_config

    cfg = compose(["model=moe_tiny", "model.hidden_size=16", "model.num_attention_heads=2",
                   "model.num_query_groups=2", "model.moe.num_experts=4", "model.moe.ffn_hidden_size=8",
                   "model.moe.z_loss_coeff=null", "model.moe.aux_loss_coeff=0", "model.vocab_size=32"])
    shape = ModelShape.of(cfg.model)
    moe = MoE(transformer_config(cfg, shape), layer_number=1)
    r, alpha, g = 3, 6.0, torch.Generator().manual_seed(0)
    assert add_adapters(moe, ["linear_fc1", "linear_fc2"], r, alpha) == {"linear_fc1": 4, "linear_fc2": 4}
    experts = moe.experts.local_experts
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "lora" in name else 1.0))  # B nonzero
            p.requires_grad_("lora" in name)
    routed = {}
    moe.router.register_forward_hook(lambda m, i, out: routed.update(probs=out[0].detach(), map=out[1]))
    x = torch.randn(6, 2, 16, generator=g)  # [s, b, h]
    y_grad = torch.randn(6, 2, 16, generator=g)
    out, _ = moe(x)
    (out * y_grad).sum().backward()

    tokens, want, s = x.view(-1, 16), torch.zeros(12, 16), alpha / r
    leaves = [[lin.lora_a.detach().clone().requires_grad_(True) for lin in (e.linear_fc1, e.linear_fc2)] +
              [lin.lora_b.detach().clone().requires_grad_(True) for lin in (e.linear_fc1, e.linear_fc2)]
              for e in experts]
    for j, (e, (a1, a2, b1, b2)) in enumerate(zip(experts, leaves)):
        chosen = routed["map"][:, j]
        gate, up = (tokens[chosen] @ (e.linear_fc1.weight + s * b1 @ a1).T).chunk(2, dim=-1)
        hidden = F.silu(gate) * up * routed["probs"][chosen, j, None]
        want = want.index_add(0, chosen.nonzero()[:, 0], hidden @ (e.linear_fc2.weight + s * b2 @ a2).T)
    (want * y_grad.view(-1, 16)).sum().backward()
    assert routed["map"].sum(dim=0).min() > 0, "every expert must get tokens"
    assert (d := max_rel_diff(out.view(-1, 16).detach(), want.detach())) < 1e-6, f"output off by {d:.2e}"
    for j, (e, (a1, a2, b1, b2)) in enumerate(zip(experts, leaves)):
        for got, ref in ((e.linear_fc1.lora_a, a1), (e.linear_fc2.lora_a, a2), (e.linear_fc1.lora_b, b1),
                         (e.linear_fc2.lora_b, b2)):
            assert (d := max_rel_diff(got.grad, ref.grad)) < 1e-6, f"expert {j}: adapter gradient off by {d:.2e}"
        assert e.linear_fc1.weight.grad is None


# ---- checkpoints and export: adapters saved at ep2 reshard to one process --------------------------------------
CKPT = ["model=moe_tiny", "model.moe.ffn_hidden_size=32"]  # with runs.QUICK: 2 layers, the byte tokenizer
TUNE = ["peft=lora", "peft.rank=4", "peft.alpha=8", "optim.lr=1e-2", "checkpoint.keep=0", "train.save_interval=2"]


def _export(ckpt: str, root: str) -> dict:
    """tools/convert_hf.py export of an adapters-only checkpoint, at one process: --merge --check, and --adapter."""
    import sys

    from hf_interop import ROOT, convert_main

    sys.path.insert(0, str(ROOT / "tools"))
    import convert_hf

    return {how: convert_main(convert_hf, ["export", "--ckpt", ckpt, "--out", f"{root}/{how}", f"--{how}",
                                           *(["--check"] if how == "merge" else [])]) for how in ("merge", "adapter")}


def test_expert_adapters_saved_at_ep2_resume_and_export_at_one_process(tmp_path):
    """A LoRA fine-tune of moe_tiny at ep2 from a base checkpoint saves its adapters (and their Adam state) under
    the experts' global keys: resumed from iteration 2 at one process (ep1), iteration 3's loss is the ep2 run's;
    export --merge from that checkpoint matches our logits in transformers (Mixtral); export --adapter is refused
    in one line (transformers' fused experts)."""
    from hf_interop import relative_diff
    from runs import train

    train([*CKPT, "train.iters=1"], 1, tmp_path / "base")
    tune = [*CKPT, *TUNE, "train.iters=3"]
    ep2 = train([*tune, f"checkpoint.load={tmp_path}/base/checkpoints/iter_0000001", "checkpoint.finetune=true",
                 "parallel.ep=2"], 2, tmp_path / "ep2")
    saved = str(tmp_path / "ep2" / "checkpoints" / "iter_0000002")
    ep1 = train([*tune, f"checkpoint.load={saved}"], 1, tmp_path / "ep1")
    assert sorted(ep1) == [3] and ep1[3] == pytest.approx(ep2[3], rel=1e-6), (ep1, ep2)
    out = run_distributed(_export, 1, (saved, str(tmp_path / "out")), timeout=300)[0]
    code, stdout, stderr = out["merge"]
    assert code == 0 and relative_diff(stdout) <= 1e-5, (code, stdout, stderr)
    code, stdout, stderr = out["adapter"]
    assert code == 2 and stderr.strip().splitlines()[-1].startswith("error: ") and "export --merge" in stderr, stderr
