"""Run training steps of the GPT at any layout, from the same full weights or from its own initialisation,
and gather what it produced (losses, grad norms, logits, the weights before and after, every parameter's
last gradient) back into full, single-process shapes.

The parent test process calls `run_layout(overrides, world_size, weights, batch)`; inside each rank
the model is built by the real engine (training.engine.build: Megatron-Core DDP, schedules,
finalize_model_grads), the full weights are sliced into this rank's shards, and the step runs through
`training.engine.step.run_schedule`. Each rank returns its shards tagged with how they were cut; `assemble`
glues them back (and checks that replicas agree).
"""

from __future__ import annotations

import torch
from harness import run_distributed
from torch.distributed.tensor import DTensor

VOCAB = 101  # deliberately not a multiple of 2: padding must not change anything
# Llama 3's and Qwen's attention options: QK-norm (Qwen3), biases on q, k, v only (Qwen2), a head dim (24) with
# heads x head dim != hidden, Llama 3's RoPE scaling (wavelengths 16..64 smoothed, longer ones divided by 4)
FAMILY_OPTIONS = ["model.qk_norm=true", "model.qkv_bias=true", "model.kv_channels=24", "model.rope_scaling.type=llama3",
                  "model.rope_scaling.factor=4", "model.rope_scaling.original_max_position=64"]


def model_overrides(*extra: str) -> list[str]:
    """The small model every equivalence case starts from (GQA, SwiGLU, RMSNorm, RoPE, tied)."""
    base = ["model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4",
            "model.num_query_groups=2", "model.ffn_hidden_size=96", "model.seq_length=16",
            f"model.vocab_size={VOCAB}", "model.make_vocab_size_divisible_by=1",
            "train.micro_batch_size=2", "train.global_batch_size=4", "checkpoint=none",
            "optim.clip_grad=0.0", "train.tensorboard=false"]
    return base + list(extra)


def make_batch(global_batch: int, seq: int, seed: int = 0) -> list[dict]:
    """A global batch as a list of samples (the MicroBatches reader indexes it like a dataset)."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, VOCAB, (global_batch, seq + 1), generator=g)
    mask = torch.ones(global_batch, seq)
    mask[:, :3] = 0.0  # a loss mask that actually masks something
    return [{"tokens": text[i, :-1], "labels": text[i, 1:], "loss_mask": mask[i]} for i in range(global_batch)]


def global_name(gpt, local_name: str, expert_offset: int = 0) -> str:
    """decoder.layers.<local>.x -> decoder.layers.<global>.x (PP stages hold different layers), and
    ...local_experts.<local>.x -> ...local_experts.<global>.x (EP ranks hold different experts)."""
    if ".local_experts." in local_name:
        head, rest = local_name.split(".local_experts.", 1)
        index, rest = rest.split(".", 1)
        local_name = f"{head}.local_experts.{int(index) + expert_offset}.{rest}"
    if local_name.startswith("decoder.layers."):
        local = int(local_name.split(".")[2])
        rest = local_name.split(".", 3)[3]
        return f"decoder.layers.{gpt.decoder.layers[local].layer_number - 1}.{rest}"
    if local_name == "output_layer.weight" and gpt.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
    return local_name


def shard(full: torch.Tensor, param: torch.nn.Parameter, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice of a full tensor, cut as Megatron-Core's CPU init cuts it (dim, stride)."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:  # whole (a replicated vocabulary:
        rows = param.shape[0]  # its rows padded as at the layout's tp)
        return torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])]) if full.dim() and \
            full.shape[0] < rows else full
    dim, stride = param.partition_dim, param.partition_stride
    rows = param.shape[dim] * tp_size  # padded size (vocab) may exceed the full tensor's
    if full.shape[dim] < rows:
        pad_shape = list(full.shape)
        pad_shape[dim] = rows - full.shape[dim]
        full = torch.cat([full, torch.zeros(pad_shape, dtype=full.dtype)], dim=dim)
    pieces = torch.split(full, param.shape[dim] // stride, dim=dim)
    return torch.cat(pieces[tp_rank::tp_size], dim=dim)


def assemble(parts: list[tuple], full_rows: int | None) -> torch.Tensor:
    """Inverse of `shard` from every rank's (tp_rank, tp_size, dim, stride, tensor) pieces."""
    by_rank: dict[int, list] = {}
    for part in parts:
        by_rank.setdefault(part[0], []).append(part)
    for rank_parts in by_rank.values():  # replicas (DP, or TP-replicated params) must agree exactly
        for other in rank_parts[1:]:
            torch.testing.assert_close(other[4], rank_parts[0][4], rtol=0, atol=0)
    tp_rank, tp_size, dim, stride, tensor = by_rank[0][0]
    if dim is None or tp_size == 1:
        if len(by_rank) > 1:  # TP-replicated parameter: all TP ranks must agree
            for r in by_rank:
                torch.testing.assert_close(by_rank[r][0][4], tensor, rtol=1e-6, atol=1e-7)
        out = tensor
    else:
        chunks = [torch.split(by_rank[r][0][4], by_rank[r][0][4].shape[dim] // stride, dim=dim)
                  for r in range(tp_size)]
        out = torch.cat([chunks[r][s] for s in range(stride) for r in range(tp_size)], dim=dim)
    if full_rows is not None and out.shape[0] > full_rows:
        out = out[:full_rows]  # drop vocab padding
    return out


def _one_layout(overrides: list[str], weights: dict | None, batch: list[dict], steps: int,
                want_logits: bool) -> dict:
    """One layout in an existing process group: build, load, train, gather; groups reset after."""
    from megatron.core import parallel_state as ps

    from models.gpt import num_params
    from models.shape import ModelShape
    from models.spec import extra_stats
    from training.config.compose import compose
    from training.config.validate import validate
    from training.data.streams import micro_batch_streams
    from training.engine.build import build
    from training.engine.losses import extra_losses, global_loss
    from training.engine.step import run_schedule, train_step
    from training.parallel import dist as D
    from training.parallel.wrap import unwrap

    cfg = compose(overrides)
    layout = validate(cfg)
    p = cfg.parallel
    info = D.init(**{**D.layout_of(cfg), "timeout_minutes": 2})
    try:
        experts = cfg.model.moe.num_experts or 1
        offset = ps.get_expert_model_parallel_rank() * (experts // p.ep)  # this rank's first expert

        def tp_of(param) -> tuple[int, int]:  # expert weights are split over the expert-TP group
            if getattr(param, "allreduce", True):
                return ps.get_tensor_model_parallel_rank(), p.tp
            return ps.get_expert_tensor_parallel_rank(), p.etp

        def name_of(gpt, name):
            return global_name(gpt, name, offset)

        def load(chunks):  # before DDP / FSDP wrap them: the optimizer's main params start from these
            with torch.no_grad():
                for chunk in chunks:
                    gpt = unwrap(chunk)
                    for name, param in gpt.named_parameters():
                        param.copy_(shard(weights[name_of(gpt, name)], param, *tp_of(param)))

        state = build(cfg, ModelShape.of(cfg.model, VOCAB), info.device, prepare=load if weights is not None else None)
        # Init drew a layout-dependent amount of random numbers (padded vocab): restart the streams so
        # dropout masks do not depend on it.
        D.set_seeds(cfg.train.seed)

        def iterators():
            return micro_batch_streams(len(state.model), batch, 0, cfg.train.micro_batch_size,
                                       every_stage="segment_ids" in batch[0])  # packed: every stage reads

        def tagged(param, tensor):
            parallel = getattr(param, "tensor_model_parallel", False)
            if isinstance(tensor, DTensor):  # Megatron-FSDP: this rank's piece; its mesh may span TP too
                names = tensor.device_mesh.mesh_dim_names or ()
                spans_tp = any(name == "tp" and placement.is_shard()
                               for name, placement in zip(names, tensor.placements))
                tensor = fsdp_full(tensor)  # TP ranks' shards side by side when spans_tp: keep this rank's
                if parallel and spans_tp:
                    tensor = tensor.chunk(p.tp, dim=param.partition_dim)[ps.get_tensor_model_parallel_rank()]
            return (*tp_of(param), param.partition_dim if parallel else None,
                    param.partition_stride if parallel else 1, tensor.detach().float().clone())

        losses, extras, norms, grads, params, before = [], [], [], {}, {}, {}
        if steps > 1:  # the initial weights too (the next layouts load them)
            for chunk in state.model:
                gpt = unwrap(chunk)
                for name, param in gpt.named_parameters():
                    before.setdefault(name_of(gpt, name), []).append(tagged(param, param))
        for _ in range(steps - 1):
            result = train_step(state, iterators(), layout, cfg, info.device)
            losses.append(result.loss)
            extras.append(result.extra)
            norms.append(result.grad_norm)
        for chunk in state.model:  # the last step: keep the gradients, do not update (zeroed as train_step does)
            chunk.zero_grad_buffer()
        state.optimizer.zero_grad()
        losses.append(global_loss(run_schedule(state, iterators(), layout, cfg, forward_only=False),
                                  info.device).item())
        extras.append(extra_losses(extra_stats(state.shape), info.device))
        for chunk in state.model:
            gpt = unwrap(chunk)
            for name, param in gpt.named_parameters():
                # The distributed optimizer reduce-scatters: each DP rank holds only its shard of the grads.
                if not cfg.parallel.dist_opt:
                    grads.setdefault(name_of(gpt, name), []).append(tagged(param, param.main_grad))
                params.setdefault(name_of(gpt, name), []).append(tagged(param, param))
        # this rank's parameters, built vs the memory estimate's count (models/gpt.py num_params)
        built = sum(param.numel() for chunk in state.model for param in unwrap(chunk).parameters())
        estimated = num_params(state.shape, p.tp, p.pp, ps.get_pipeline_model_parallel_rank(), p.vpp, p.ep, p.etp,
                               tp_blocks=layout.tp_blocks)
        out = {"losses": losses, "extra": extras, "grad_norms": norms, "grads": grads, "params": params,
               "before": before,
               "counts": (built, estimated),
               "expert_buffers": sum(len(getattr(chunk, "expert_parallel_buffers", [])) for chunk in state.model)}
        if want_logits and p.pp == 1:
            from training.parallel.context import gather_sequence, split_batch

            model = state.model[0]  # through DDP / FSDP (FSDP gathers its parameters in its forward hooks)
            model.eval()
            mine = split_batch({"tokens": torch.stack([s["tokens"] for s in batch])})  # CP: [b, s/cp]
            with torch.no_grad():
                logits = model(mine["tokens"], position_ids=mine.get("position_ids"))  # [b, s/cp, V_padded/tp]
                logits = gather_sequence(logits, dim=1)  # [b, s, V_padded/tp]
            out["logits"] = (ps.get_tensor_model_parallel_rank(), p.tp, 2, 1, logits.float())
        return out
    finally:
        D.reset_model_parallel()


def fsdp_full(dtensor: DTensor) -> torch.Tensor:
    """A Megatron-FSDP parameter (a DTensor whose DP shards are uneven: not DTensor.full_tensor's chunking,
    and gloo has no uneven all-gather) as the full TP-local tensor on every DP rank: each rank places its
    piece at the offsets Megatron-FSDP computes, and the DP group sums them."""
    import torch.distributed as dist
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import gather_and_compute_chunk_metadata

    meta = gather_and_compute_chunk_metadata(dtensor)
    full = torch.zeros(dtensor.shape, dtype=torch.float32)
    full[tuple(slice(o, o + n) for o, n in zip(meta.offsets, meta.sizes))] = dtensor.to_local().float()
    for dim, placement in enumerate(dtensor.placements):
        if placement.is_shard():
            dist.all_reduce(full, group=dtensor.device_mesh.get_group(dim))
    return full


def _rank_steps(specs: list[tuple], batch: list[dict]) -> list:
    """Every spec in turn in one process group (imports and the group are paid for once)."""
    import traceback

    from training.parallel import dist as D

    results = []
    try:
        for overrides, weights, steps, want_logits in specs:
            try:
                results.append(_one_layout(overrides, weights, batch, steps, want_logits))
            except Exception:  # noqa: BLE001 - reported for this spec, the others still run
                results.append({"error": traceback.format_exc()})
    finally:
        D.teardown()
    return results


def _gather(per_rank: list[dict]) -> dict:
    errors = [r["error"] for r in per_rank if "error" in r]
    if errors:
        raise AssertionError("layout failed:\n" + "\n".join(errors))
    grads: dict[str, list] = {}
    params: dict[str, list] = {}
    before: dict[str, list] = {}
    for r in per_rank:
        for gathered, key in ((grads, "grads"), (params, "params"), (before, "before")):
            for name, parts in r[key].items():
                gathered.setdefault(name, []).extend(parts)
    losses = [r["losses"] for r in per_rank]
    for other in losses[1:]:
        assert other == losses[0], f"ranks disagree on the loss: {losses}"
    extras = [r["extra"] for r in per_rank]
    assert all(e == extras[0] for e in extras), f"ranks disagree on the extra losses: {extras}"
    norms = [r["grad_norms"] for r in per_rank]
    assert all(n == norms[0] for n in norms), f"ranks disagree on the grad norms: {norms}"
    rows = lambda name: VOCAB if "word_embeddings" in name or "output_layer" in name else None  # noqa: E731
    out = {"losses": losses[0], "extra": extras[0], "grad_norms": norms[0], "counts": [r["counts"] for r in per_rank],
           "expert_buffers": [r["expert_buffers"] for r in per_rank],
           "grads": {n: assemble(parts, rows(n)) for n, parts in grads.items()},
           "params": {n: assemble(parts, rows(n)) for n, parts in params.items()},
           "params_before": {n: assemble(parts, rows(n)) for n, parts in before.items()}}
    logits = {r["logits"][0]: r["logits"][4] for r in per_rank if "logits" in r}  # by TP rank
    if logits:  # vocab-parallel shards side by side, padding dropped
        out["logits"] = torch.cat([logits[r] for r in sorted(logits)], dim=-1)[..., :VOCAB]
    return out


def run_layouts(specs: list[tuple], world_size: int, batch: list[dict], timeout: float = 600.0) -> list:
    """specs: (overrides, weights or None, steps, want_logits) run one after another in the same
    `world_size` processes. For each: the loss per step, and the last step's full gradients, final
    full parameters (and logits at PP=1); or the exception, raised when that result is used."""
    per_rank = run_distributed(_rank_steps, world_size, (specs, batch), timeout=timeout)
    results = []
    for i in range(len(specs)):
        try:
            results.append(_gather([rank[i] for rank in per_rank]))
        except AssertionError as err:
            results.append(err)
    return results


def run_layout(overrides: list[str], world_size: int, weights: dict | None, batch: list[dict],
               steps: int = 1, want_logits: bool = False, timeout: float = 300.0) -> dict:
    (result,) = run_layouts([(overrides, weights, steps, want_logits)], world_size, batch, timeout)
    if isinstance(result, Exception):
        raise result
    return result


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (elementwise rtol is meaningless for values near zero)."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()
