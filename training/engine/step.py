"""One training step, top to bottom, and one evaluation pass.

    result = train_step(state, streams, layout, cfg, device)   # StepResult(loss, grad_norm, skipped, extra)

A step: zero the gradient buffers -> the token ids of the step's micro-batches checked against the vocabulary
(training/data/batch_check.py: damaged data stops here, before any forward) -> Megatron-Core's pipeline
schedule (`get_forward_backward_func`: no pipelining, 1F1B, or interleaved 1F1B) runs forward and backward over
this DP rank's micro-batches and calls `finalize_model_grads` (DP reduction, SP norm grads, tied-embedding
grads, division by the global batch's token count) -> the LM loss reduced to the global-batch token mean and
the extra losses to theirs -> the NaN/Inf checks of the loss and of every rank's gradients (bf16 has no loss
scaler to catch a non-finite gradient, and clipping would spread it into every weight) -> `optimizer.step()` (clipping
inside) -> the scheduler step. A non-finite step stops the run or is skipped on every rank alike
(train.nan_policy): the weights and the optimizer state never take it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from models.spec import extra_stats
from training.config.schema import Config, NanPolicy
from training.data.batch_check import check_token_ids
from training.engine.build import TrainState
from training.engine.losses import extra_losses, global_loss_sum, loss_func
from training.errors import TemplateError
from training.parallel import dist as D
from training.parallel.context import split_batch
from training.parallel.layout import Layout
from training.parallel.wrap import unwrap


class NonFiniteLoss(TemplateError):
    pass


@dataclass
class StepResult:
    loss: float  # the global-batch token mean of the LM loss (identical on every rank)
    grad_norm: float | None  # before clipping; None when the step was skipped
    skipped: bool  # no update (train.nan_policy=skip and a non-finite loss)
    extra: dict[str, float | None] = field(default_factory=dict)  # the named extra losses, global means
    loss_tokens: int = 0  # the global batch's loss tokens (with data.format=sft: the answers' tokens)
    lr: float | None = None  # the learning rate this step's update used (the scheduler then moves to the next)


def forward_step(data_iterator, model):
    """Called by the schedule once per micro-batch and model chunk."""
    batch = split_batch(next(data_iterator)) if data_iterator is not None else None  # CP: [b, s/cp] each
    gpt, device = unwrap(model), D.current_device()
    tokens = batch["tokens"].to(device) if gpt.pre_process else None  # [b, s(/cp)]
    labels = batch["labels"].to(device) if gpt.post_process else None  # [b, s(/cp)]
    # packed sequences (data.format=sft): every stage takes each token's segment and position; CP: the first
    # stage takes the zigzag positions (learned position embeddings read them)
    packed = batch is not None and "segment_ids" in batch
    positions = batch["position_ids"].to(device) if batch is not None and "position_ids" in batch and \
        (packed or gpt.pre_process) else None  # [b, s(/cp)]
    segments = batch["segment_ids"].to(device) if packed else None  # [b, s]
    # the last stage's token losses [b, s(/cp)], or this stage's activations
    output = model(tokens, labels, position_ids=positions, segment_ids=segments)
    mask = batch["loss_mask"].to(device) if gpt.post_process else None
    return output, partial(loss_func, mask)


def run_schedule(state: TrainState, streams, layout: Layout, cfg: Config, forward_only: bool,
                 step=forward_step) -> list[dict]:
    """The pipeline schedule over one global batch; returns the last stage's per-micro-batch reports."""
    check_token_ids(streams, layout.num_microbatches, state.shape.vocab_size, D.current_device())  # damaged data
    return get_forward_backward_func()(
        forward_step_func=step, data_iterator=streams, model=state.model,
        num_microbatches=layout.num_microbatches, seq_length=cfg.model.seq_length,
        micro_batch_size=cfg.train.micro_batch_size, forward_only=forward_only)


def grad_buffers(chunk) -> list[torch.Tensor]:
    """A wrapped chunk's gradients: DDP's flat dense and expert buffers, or Megatron-FSDP's parameters' pieces
    in this rank's shard of each group's buffer (its padding is never written: not read)."""
    if hasattr(chunk, "expert_parallel_buffers"):  # DistributedDataParallel
        return [buffer.grad_data for buffer in (*chunk.buffers, *chunk.expert_parallel_buffers)]
    buffers = [group.main_grad_buffer for group in chunk.param_and_grad_buffer.parameter_groups
               if group.main_grad_buffer is not None]  # FullyShardedDataParallel
    return [buffer.get_item(item) for buffer in buffers for item in buffer.item_index_map]


def nonfinite_grad_ranks(state: TrainState, device: torch.device) -> list[int]:
    """The ranks whose gradient buffers (as finalize_model_grads left them) hold a NaN or Inf (or sum past
    fp32's range, 3e38: no sane step does); one all-reduce, the same answer on every rank."""
    bad = torch.zeros(dist.get_world_size(), device=device)
    for chunk in state.model:
        for grads in grad_buffers(chunk):  # a NaN or Inf anywhere makes the sum non-finite: one read, no copy
            bad[dist.get_rank()] += ~torch.isfinite(grads.sum())
    dist.all_reduce(bad)
    return bad.nonzero().flatten().tolist()


def train_step(state: TrainState, streams, layout: Layout, cfg: Config, device: torch.device,
               step=forward_step, summary=None) -> StepResult:
    """step: the forward step (a post-training objective's: training/post/step.py); summary(reports, device): its
    metrics from the last stage's reports, reduced, logged with the extra losses."""
    for chunk in state.model:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    reports = run_schedule(state, streams, layout, cfg, forward_only=False, step=step)
    total = global_loss_sum(reports, device)  # [loss sum, loss tokens] of the global batch
    loss, tokens = (total[0] / total[1].clamp(min=1)).item(), int(total[1].item())
    extra = extra_losses(extra_stats(state.shape), device)
    if summary is not None:
        extra |= summary(reports, device)
    problem = f"loss is {loss}" if not math.isfinite(loss) else None
    if problem is None and (ranks := nonfinite_grad_ranks(state, device)):
        problem = f"the gradients are not finite (NaN/Inf) on rank{'s' if len(ranks) > 1 else ''} " \
                  f"{', '.join(map(str, ranks))} (loss {loss:.4f})"
    if problem is not None:
        if cfg.train.nan_policy == NanPolicy.stop:
            raise NonFiniteLoss(f"{problem} at this step: stopping (train.nan_policy=stop) before the update; the "
                                f"last checkpoint is intact. Lower optim.lr or set train.nan_policy=skip")
        return StepResult(loss, None, True, extra, tokens)  # skip: no update anywhere, gradients are zeroed next step
    lr = state.optimizer.param_groups[0]["lr"]  # what this update uses (Megatron-Core's warmup: 0 at the first)
    _, grad_norm, _ = state.optimizer.step()
    state.scheduler.step(increment=1)
    return StepResult(loss, None if grad_norm is None else float(grad_norm), False, extra, tokens, lr)


def evaluate(state: TrainState, make_streams, layout: Layout, cfg: Config, device: torch.device) -> dict[str, float]:
    """The token-mean LM loss (forward only) over the first train.eval_iters global batches of the streams
    make_streams() starts (the validation split: the same batches at every evaluation; tools/evaluate.py
    computes the same number from a checkpoint), as {"val_loss": ...}."""
    for chunk in state.model:
        chunk.eval()
    streams = make_streams()  # one pass: batch k of the evaluation is the split's k-th global batch
    total = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for _ in range(cfg.train.eval_iters):
            total += global_loss_sum(run_schedule(state, streams, layout, cfg, forward_only=True), device)
    for chunk in state.model:
        chunk.train()
    return {"val_loss": (total[0] / total[1].clamp(min=1)).item()}
