"""training/shims/cpu_compat.py: each patch, and each Megatron-Core piece it makes run on gloo.

Pieces covered here: version pinning, scoping of the patches, the RNG tracker
(model_parallel_cuda_manual_seed, fork), tensor_parallel.checkpoint's RNG replay, DDP with and
without overlapped grad reduction, get_megatron_optimizer with and without the distributed optimizer
in fp32 and bf16. Sequence parallel's buffers and the pipeline schedules (1F1B, interleaved) are
covered by tests/test_model_parallel_equivalence.py; dist_checkpointing by tests/test_checkpoint.py.
"""

import pytest
import torch
from harness import run_distributed
from layouts import make_batch, max_rel_diff, model_overrides, run_layouts


def test_other_megatron_core_versions_are_refused_in_one_line():
    from training.shims.cpu_compat import McoreVersionError, check_mcore_version

    check_mcore_version("0.19.2")
    with pytest.raises(McoreVersionError) as err:
        check_mcore_version("0.16.1")
    message = str(err.value)
    assert "\n" not in message and "0.16.1" in message and "megatron-core==0.19.2" in message


def _patch_scope():
    from training.shims import cpu_compat

    assert cpu_compat.apply() is True
    import megatron.core.optimizer.optimizer as mcore_optimizer
    import megatron.core.utils as mcore_utils
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import random as mcore_random

    class Rank1Of2:  # a context-parallel group as get_pos_emb_on_this_cp_rank reads it
        size, rank = (lambda self: 2), (lambda self: 1)

    here = torch.zeros(2)
    result = {
        # pins its index tensor (pin_memory=True needs CUDA) and moves it with .cuda()
        "cp_rope_slice": rope_utils.get_pos_emb_on_this_cp_rank(torch.arange(8.0), 0, Rank1Of2()).tolist(),
        "torch_cuda_current_device_is_untouched": torch.cuda.current_device is not mcore_utils.torch.cuda.current_device,
        "mcore_sees_cpu": mcore_utils.torch.cuda.current_device() == torch.device("cpu"),
        "mcore_factory_maps_cuda": mcore_utils.torch.zeros(1, device="cuda").device.type,
        # patch 7: Megatron-FSDP's f"cuda:{torch.cuda.current_device()}", and isinstance still works
        "mcore_device_string": str(mcore_utils.torch.device(f"cuda:{mcore_utils.torch.cuda.current_device()}")),
        "mcore_device_isinstance": isinstance(torch.device("cpu"), mcore_utils.torch.device),
        "type_outside_mcore": here.type(),
        "set_rng_state_replaced": mcore_random._set_cuda_rng_state.__name__,
    }
    try:
        here.cuda()
        result["cuda_outside_mcore"] = "no error"
    except (RuntimeError, AssertionError) as err:  # torch refuses: there is no GPU
        result["cuda_outside_mcore"] = type(err).__name__
    # What callers inside megatron.core.optimizer see (a function defined in that namespace).
    namespace = {"__name__": mcore_optimizer.__name__}
    exec("def probe(t):\n    return t.type()", namespace)
    result["type_inside_mcore_optimizer"] = namespace["probe"](here)
    return result


def test_patches_are_scoped_to_megatron_core():
    if torch.cuda.is_available():
        pytest.skip("the CPU patches are only applied without CUDA")
    (result,) = run_distributed(_patch_scope, 1, timeout=120)
    assert result["torch_cuda_current_device_is_untouched"]
    assert result["mcore_sees_cpu"]
    assert result["mcore_factory_maps_cuda"] == "cpu"
    assert result["mcore_device_string"] == "cpu" and result["mcore_device_isinstance"]
    assert result["cp_rope_slice"] == [2.0, 3.0, 4.0, 5.0]  # chunks 1 and 2 of 4: rank 1's zigzag share
    assert result["type_outside_mcore"] == "torch.FloatTensor"
    assert result["type_inside_mcore_optimizer"] == "torch.cuda.FloatTensor"
    assert result["cuda_outside_mcore"] != "no error"
    assert result["set_rng_state_replaced"] == "_set_rng_state_on_cpu"


def _rng_and_recompute():
    from megatron.core import tensor_parallel

    from training.parallel import dist as D

    with D.distributed(tp=2, seed=7, timeout_minutes=2):
        tracker = tensor_parallel.get_cuda_rng_tracker()
        torch.manual_seed(123)
        plain = torch.rand(4)
        with tracker.fork():
            forked = torch.rand(4)  # the TP-distinct stream
        after_fork = torch.rand(4)  # the default stream continues as if fork never happened

        # tensor_parallel.checkpoint replays dropout in backward: same grads as no recompute.
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        w = torch.randn(16, 16, generator=torch.Generator().manual_seed(2))

        def block(inp, weight):
            with tracker.fork():
                return torch.nn.functional.dropout(inp @ weight, p=0.5, training=True)

        grads = []
        for recompute in (False, True):
            state = tracker.get_states()
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = tensor_parallel.checkpoint(block, False, xi, wi) if recompute else block(xi, wi)
            out.sum().backward()
            grads.append((out.detach(), xi.grad, wi.grad))
            tracker.set_states(state)
        return plain, forked, after_fork, grads


def test_rng_tracker_streams_and_recompute_replay():
    (p0, f0, a0, g0), (p1, f1, a1, g1) = run_distributed(_rng_and_recompute, 2, timeout=120)
    assert torch.equal(p0, p1), "default stream must be identical on TP ranks"
    assert not torch.equal(f0, f1), "the tracker's model-parallel stream must differ across TP ranks"
    torch.manual_seed(123)
    reference = torch.rand(8)
    assert torch.equal(p0, reference[:4])
    assert torch.equal(a0, reference[4:]), "fork() must leave the default stream as if it never ran"
    for rank_grads in (g0, g1):
        (out, gx, gw), (out_r, gx_r, gw_r) = rank_grads
        assert torch.equal(out, out_r) and torch.equal(gx, gx_r) and torch.equal(gw, gw_r)
        assert (out == 0).any(), "dropout must actually drop something"


# DDP / optimizer paths: two optimizer steps at DP=2 against the same two steps in one process.
OPTIMIZER_CASES = {
    "ddp": ([], 1e-5),
    "ddp-overlap-grad-reduce": (["parallel.overlap_grad_reduce=true"], 1e-5),
    "distopt": (["parallel.dist_opt=true"], 1e-5),
    "distopt-overlap": (["parallel=distopt"], 1e-5),
    # bf16 params (fp32 main params and grads): the DP reduction order may flip a bf16 rounding
    # (2^-8 relative) in a few elements; 1e-2 is just over one bf16 ulp.
    "bf16-distopt": (["train.precision=bf16", "parallel.dist_opt=true"], 1e-2),
}


# Clipping at 1e9 computes the grad norm and never rescales (a doubled gradient would be clipped back to the
# same norm on both sides); Adam's eps 1e-4 keeps the update proportional to the gradient where it is small
# (with 1e-8 Adam divides any scale away), so a wrongly scaled gradient also moves the weights differently.
COMMON = ["model.num_layers=2", "optim.clip_grad=1e9", "optim.adam_eps=1e-4", "optim.warmup_iters=0"]


@pytest.fixture(scope="module")
def optimizer_runs():
    """3 steps (2 updates) per case at DP=2 in one process group, and the 1-process references.
    tp=1 everywhere: the same seed gives the same initial weights, nothing needs loading."""
    batch = make_batch(global_batch=4, seq=16)
    refs = dict(zip(("fp32", "bf16"), run_layouts(
        [(model_overrides(*COMMON, f"train.precision={p}"), None, 3, False) for p in ("fp32", "bf16")], 1, batch)))
    cases = dict(zip(OPTIMIZER_CASES, run_layouts(
        [(model_overrides(*COMMON, *extra), None, 3, False) for extra, _ in OPTIMIZER_CASES.values()], 2, batch)))
    return refs, cases


@pytest.mark.parametrize("case", list(OPTIMIZER_CASES))
def test_ddp_and_optimizer_match_one_process(case, optimizer_runs):
    refs, cases = optimizer_runs
    extra, tol = OPTIMIZER_CASES[case]
    ref, out = refs["bf16" if "train.precision=bf16" in extra else "fp32"], cases[case]
    for result in (ref, out):
        if isinstance(result, Exception):
            raise result
    assert out["losses"] == pytest.approx(ref["losses"], rel=tol), (out["losses"], ref["losses"])
    assert out["losses"][2] < out["losses"][0], "the optimizer must actually train"
    # what the optimizer saw: the global norm of the DP-reduced gradients (the distributed optimizer's over its shards)
    assert len(out["grad_norms"]) == 2 and None not in out["grad_norms"]
    assert out["grad_norms"] == pytest.approx(ref["grad_norms"], rel=tol), (out["grad_norms"], ref["grad_norms"])
    # the last step's DP-reduced main_grad, whole on every rank without the distributed optimizer (it keeps shards)
    sharded = any("dist_opt" in e or "distopt" in e for e in extra)
    assert set(out["grads"]) == (set() if sharded else set(ref["grads"])), case
    for name, grad in out["grads"].items():
        assert max_rel_diff(grad, ref["grads"][name]) <= tol, f"{name}: gradient differs from one process"
    for name, param in ref["params"].items():
        assert max_rel_diff(out["params"][name], param) <= tol, name


def _moe_dispatch_patches():
    """Patches 5 and 6 on 2 gloo ranks, against what the collectives must give; and that without patch 6
    gloo refuses the uneven gather (the reason it exists)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import token_dispatcher

    from training.parallel import dist as D

    with D.distributed(tp=2, timeout_minutes=2):
        group, rank = ps.get_tensor_model_parallel_group(), dist.get_rank()
        splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
        sizes = [3, 1]  # rank 0 holds 3 rows, rank 1 holds 1
        mine = torch.arange(sizes[rank] * 2, dtype=torch.float32).view(-1, 2) + 10 * rank  # [rows, 2]
        gathered = mappings._gather_along_first_dim(mine, group, output_split_sizes=splits)
        full = torch.arange(8, dtype=torch.float32).view(4, 2) * (rank + 1)  # [3 + 1, 2]
        reduced = mappings._reduce_scatter_along_first_dim(full, group, input_split_sizes=splits)
        try:  # Megatron-Core's own uneven gather on gloo
            blocks = list(torch.split(torch.empty(4, 2), sizes))
            dist.all_gather(blocks, mine, group=group)
            unpatched = "no error"
        except (RuntimeError, ValueError) as err:
            unpatched = type(err).__name__
        return {"splits_type": type(splits).__name__, "gathered": gathered, "reduced": reduced,
                "unpatched": unpatched}


def test_moe_dispatch_patches_on_gloo():
    if torch.cuda.is_available():
        pytest.skip("the CPU patches are only applied without CUDA")
    results = run_distributed(_moe_dispatch_patches, 2, timeout=120)
    expected = torch.cat([torch.arange(6, dtype=torch.float32).view(3, 2), torch.arange(2.0).view(1, 2) + 10])
    full_sum = torch.arange(8, dtype=torch.float32).view(4, 2) * 3  # ranks 0 and 1: x1 + x2
    for rank, r in enumerate(results):
        assert r["splits_type"] == "ndarray"  # patch 5: what all_to_all_single takes as split sizes
        assert torch.equal(r["gathered"], expected)  # patch 6: every rank's rows, in rank order
        assert torch.equal(r["reduced"], full_sum[:3] if rank == 0 else full_sum[3:])
        assert r["unpatched"] != "no error", "gloo now gathers uneven blocks itself: patch 6 may go"
