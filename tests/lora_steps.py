"""LoRA training steps at any layout, gathered into one process's shapes (tests/test_lora.py, test_lora_moe.py,
test_lora_canonical.py): build at a layout from a fresh initialisation with the same seed, take STEPS steps, and
return every parameter before and after, the adapters' last gradients and what DDP and the optimizer hold
(expert parameters tagged by their expert-TP shard and global expert index)."""

import torch
from layouts import assemble, global_name, make_batch, model_overrides

# clipping active (grad norms ~0.35); Adam's eps raised so an update stays proportional to its gradient (as
# tests/test_whole_step.py: a gradient off by a factor would otherwise be normalised away)
LORA = ["peft=lora", "peft.rank=4", "peft.alpha=8", "optim.clip_grad=0.1", "optim.warmup_iters=0",
        "optim.lr=1e-2", "optim.adam_eps=1e-4"]
# adapters after 3 updates, last gradients: TP/DP sum in another order (measured <= 3.5e-6 of a tensor's scale;
# they move by ~0.06 of it); losses and grad norms measured <= 1.1e-7
TENSOR_RTOL, RTOL = 3e-5, 1e-6
STEPS = 3
BATCH = make_batch(global_batch=4, seq=16)


def _train(overrides: list[str], batch: list[dict]) -> dict:
    """Build at this layout (fresh init), train STEPS steps; every parameter before and after (tagged as
    layouts.assemble wants), the adapters' last gradients, and what the optimizer and DDP hold."""
    from megatron.core import parallel_state as ps

    from models.lora import is_adapter
    from models.shape import ModelShape
    from training.config.compose import compose
    from training.config.validate import validate
    from training.data.streams import micro_batch_streams
    from training.engine.build import build
    from training.engine.step import train_step
    from training.parallel import dist as D
    from training.parallel.wrap import unwrap

    cfg = compose(model_overrides(*LORA, *overrides))
    layout = validate(cfg)
    info = D.init(**{**D.layout_of(cfg), "timeout_minutes": 2})
    try:
        state = build(cfg, ModelShape.of(cfg.model, 101), info.device)
        D.set_seeds(cfg.train.seed)
        tp = (ps.get_tensor_model_parallel_rank(), cfg.parallel.tp)
        etp = (ps.get_expert_tensor_parallel_rank(), cfg.parallel.etp)  # experts' shards (allreduce=False)
        offset = ps.get_expert_model_parallel_rank() * ((cfg.model.moe.num_experts or 1) // cfg.parallel.ep)

        def tagged(param, tensor):
            split = getattr(param, "tensor_model_parallel", False)
            return (*(tp if getattr(param, "allreduce", True) else etp), param.partition_dim if split else None,
                    param.partition_stride if split else 1, tensor.detach().float().clone())

        def snapshot(grads: bool = False) -> dict:
            out = {}
            for chunk in state.model:
                gpt = unwrap(chunk)
                for name, param in gpt.named_parameters():
                    if not grads:
                        out.setdefault(global_name(gpt, name, offset), []).append(tagged(param, param))
                    elif is_adapter(name) and not cfg.parallel.dist_opt:  # dist-opt: only this rank's shard
                        out.setdefault(global_name(gpt, name, offset), []).append(tagged(param, param.main_grad))
            return out

        before, losses, norms = snapshot(), [], []
        for _ in range(STEPS):
            streams = micro_batch_streams(len(state.model), batch, 0, cfg.train.micro_batch_size)
            result = train_step(state, streams, layout, cfg, info.device)
            losses.append(result.loss)
            norms.append(result.grad_norm)
        named = [(n, p) for chunk in state.model for n, p in unwrap(chunk).named_parameters()]
        groups = [g for opt in getattr(state.optimizer, "chained_optimizers", [state.optimizer])
                  for g in opt.optimizer.param_groups]
        return {"before": before, "after": snapshot(), "grads": snapshot(grads=True), "losses": losses,
                "norms": norms,
                "trainable": sorted(n for n, p in named if p.requires_grad),
                "adapter_numel": sum(p.numel() for n, p in named if is_adapter(n)),
                "optimizer_numel": sum(p.numel() for g in groups for p in g["params"]),
                "ddp_numel": sum(p.numel() for chunk in state.model for b in chunk.buffers for p in b.params),
                "expert_ddp_numel": sum(p.numel() for chunk in state.model for b in chunk.expert_parallel_buffers
                                        for p in b.params),  # experts' adapters: in the expert-DP buffers only
                "expert_adapter_numel": sum(p.numel() for n, p in named if is_adapter(n) and ".local_experts." in n),
                "frozen_main_grads": sum(hasattr(p, "main_grad") for n, p in named if not is_adapter(n)),
                "dp": (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())}
    finally:
        D.reset_model_parallel()


def _train_all(specs: list[list[str]], batch: list[dict]) -> list[dict]:
    from training.parallel import dist as D

    try:
        return [_train(overrides, batch) for overrides in specs]
    finally:
        D.teardown()


def _gather(per_rank: list[dict]) -> dict:
    for r in per_rank[1:]:
        assert r["losses"] == per_rank[0]["losses"] and r["norms"] == per_rank[0]["norms"]
    out = {k: per_rank[0][k] for k in ("losses", "norms")}
    for key in ("before", "after", "grads"):
        parts: dict[str, list] = {}
        for r in per_rank:
            for name, tagged in r[key].items():
                parts.setdefault(name, []).extend(tagged)
        out[key] = {n: assemble(p, 101 if "word_embeddings" in n or "output_layer" in n else None)
                    for n, p in parts.items()}
    return out


def _check_rank_holdings(per_rank: list[dict], dist_opt: bool) -> None:
    """Only adapters train, sit in DDP's buffers and in the optimizer (its shards sum to them over DP)."""
    for r in per_rank:
        assert r["trainable"] and all(n.rsplit(".", 1)[-1] in ("lora_a", "lora_b") for n in r["trainable"])
        assert r["ddp_numel"] + r["expert_ddp_numel"] == r["adapter_numel"] > 0
        assert r["expert_ddp_numel"] == r["expert_adapter_numel"]
        assert r["frozen_main_grads"] == 0
        if not dist_opt:
            assert r["optimizer_numel"] == r["adapter_numel"]
    if dist_opt:  # each DP rank holds its shard of the (DP-replicated) adapters' main params
        assert sum(r["optimizer_numel"] for r in per_rank) == per_rank[0]["adapter_numel"]
        assert 0 < per_rank[0]["optimizer_numel"] < per_rank[0]["adapter_numel"]
