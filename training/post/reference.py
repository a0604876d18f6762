"""The reference's log-probs of a step's pairs, written into its micro-batches before the policy's pass.

    reference = Reference.of(cfg, state)      # live: a frozen model; lora_base: the policy, adapters off; none
    reference.score(batches)                  # each last-stage batch's "ref_logps" [b, P, 2] filled

The reference runs the same pipeline schedule as the policy (forward only, no gradients) over the very micro-batch
dicts the policy's pass will read (training/data/streams.py's read-ahead), at the training layout: its last stage
computes the answers' sums (training/post/logps.py) and stores them in the batch, where the policy's loss reads them.

    live        the weights of post.reference_load (null: checkpoint.load, the model the run starts from), built
                and resharded at this layout, frozen; a second model's memory (its weights, no gradients or Adam)
    lora_base   peft=lora: the policy itself inside models.lora.adapters_off() (the base: no second model)
    none        reference-free objectives (simpo)
"""

from __future__ import annotations

import contextlib
import copy

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from models.lora import adapters_off
from training.config.schema import Config
from training.engine.step import forward_step
from training.parallel import dist as D
from training.parallel.wrap import unwrap
from training.post.logps import answer_sums


def peek(streams, count: int):
    """The step's next `count` micro-batches of every stream (the dicts the step will read) and iterators over
    them shaped as the streams (a list per model chunk, None for a chunk that reads nothing, or one)."""
    if isinstance(streams, list):
        batches = [None if s is None else [b for _, b in s.read_ahead(count)] for s in streams]
        return batches, [None if b is None else iter(b) for b in batches]
    batches = None if streams is None else [b for _, b in streams.read_ahead(count)]
    return [batches], (None if batches is None else iter(batches))


class Reference:
    def __init__(self, chunks, config, cfg: Config, base: bool):
        self.chunks, self.config, self.cfg, self.base = chunks, config, cfg, base

    @classmethod
    def of(cls, cfg: Config, state):
        kind = str(cfg.post.reference)
        if kind in ("none", "stored"):  # stored: the batches carry the scores (training/post/stored.py)
            return None
        if kind == "lora_base":
            return cls(state.model, state.config, cfg, base=True)
        return cls(*live_model(cfg, state), cfg, base=False)

    def score(self, iterators, num_microbatches: int) -> None:
        """Fill "ref_logps" of the step's micro-batches; `iterators`: over them, shaped as the policy's streams."""
        modes = [chunk.training for chunk in self.chunks]
        for chunk in self.chunks:
            chunk.eval()  # no dropout: the reference is a fixed function
        try:
            with torch.no_grad(), adapters_off() if self.base else contextlib.nullcontext():
                get_forward_backward_func()(
                    forward_step_func=_scoring_step, data_iterator=iterators, model=self.chunks,
                    num_microbatches=num_microbatches, seq_length=self.cfg.model.seq_length,
                    micro_batch_size=self.cfg.train.micro_batch_size, forward_only=True)
        finally:
            for chunk, mode in zip(self.chunks, modes):
                chunk.train(mode)


def _scoring_step(data_iterator, model):
    batch = next(data_iterator) if data_iterator is not None else None
    output, _ = forward_step(iter([batch]) if batch is not None else None, model)

    def store(token_losses):
        sums, _ = answer_sums(token_losses, batch["answer_ids"], batch["ref_logps"].shape[1])
        batch["ref_logps"].copy_(sums)  # [b, P, 2] into the batch the policy's pass reads
        return token_losses.sum() * 0, torch.tensor(0, dtype=torch.int), {}

    return output, store


def live_model(cfg: Config, state):
    """A frozen copy of the reference checkpoint's weights at this layout: (chunks, their TransformerConfig)."""
    from training.checkpoint import read_run, resolve_path
    from training.checkpoint.common import CheckpointError, check_match
    from training.config.checkpoint_match import model_problem, tokenizer_problem
    from training.data.tokenizer import build_tokenizer
    from training.checkpoint.torch_dist import load_weights
    from training.engine.build import build

    ref_cfg = copy.deepcopy(cfg)
    ref_cfg.peft.method = type(cfg.peft.method)("none")  # the reference has no adapters
    path = resolve_path(cfg.post.reference_load or cfg.checkpoint.load)
    run = read_run(path)
    problem = tokenizer_problem(run, cfg.data.tokenizer, path, build_tokenizer) or \
        model_problem(run, state.shape, cfg.model.name, path, hint=False)  # every differing field named
    if problem:
        raise CheckpointError(f"post.reference_load: {problem}: the reference scores the policy's tokens, so it is "
                              f"the policy's model and tokenizer (the checkpoint the policy started from, or "
                              f"another fine-tune of it)")
    check_match(run, ref_cfg, state.shape, path, weights_only=True)  # what else refuses a load (LoRA adapters)
    ref = build(ref_cfg, state.shape, D.current_device(), init=False, train=False)
    load_weights(ref_cfg, path, ref.model)
    for chunk in ref.model:
        for param in chunk.parameters():
            param.requires_grad_(False)
        chunk.eval()
    D.print0(f"reference: the weights of {path}, frozen (post.reference={cfg.post.reference})")
    assert all(unwrap(c).post_process == unwrap(p).post_process for c, p in zip(ref.model, state.model))
    return ref.model, ref.config
