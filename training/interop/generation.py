"""Text from a checkpoint (tools/generate.py's back end): prompts in, new token ids out, at any TP x PP layout.

    cfg, shape, path = inference_config(ckpt, overrides)     # the checkpoint's run.json + layout overrides
    state = load_model(cfg, shape, device)                   # weights only, no optimizer
    new_ids = generate(state, prompts, max_new_tokens, Sampling(greedy=True), eod)

Prompts of different lengths share a batch: left-padded, with each sequence's own positions and a mask that
keeps padding out of attention (models/kv_cache.py). Prefill runs the prompts once, then each step runs one
token per sequence against the KV cache (use_cache=False recomputes the whole sequence every step, the
reference the cache is tested against). Every forward goes through Megatron-Core's pipeline schedule
(forward only, one micro-batch), so PP stages pass activations as in training; the last stage gathers the
vocab-parallel logits of the last position, samples, and sends the tokens to the other stages. All TP ranks
hold the same gathered logits and draw from the same seeded generator, so they agree, and TP=1 and TP=2 draw
the same tokens. One model replica: world = tp x pp.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from models.kv_cache import KVCache
from models.shape import ModelShape
from training.engine.build import TrainState, build
from training.errors import ConfigError
from training.parallel.wrap import unwrap


@dataclass(frozen=True)
class Sampling:
    greedy: bool = True  # the most likely token (ties: the lowest id)
    temperature: float = 1.0
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    top_p: float = 1.0  # keep the smallest set whose probability reaches p (nucleus); 1 = all
    seed: int = 0


def _inference_layout(cfg, for_generation: bool = True) -> None:
    if for_generation and (cfg.parallel.sp or cfg.parallel.vpp is not None or cfg.parallel.cp > 1):
        raise ConfigError("generation runs without parallel.sp, parallel.cp and parallel.vpp (one token a step "
                          "cannot be split along the sequence; the interleaved schedule needs several micro-batches)")
    cfg.model.recompute = "none"


def random_config(overrides: list[str]):
    """(config, shape, None) of a randomly initialised model: the config the overrides compose (benchmarks)."""
    from training.config.compose import compose
    from training.data.datasets import resolve_vocab_size
    from training.data.tokenizer import build_tokenizer

    cfg = compose(overrides)
    _inference_layout(cfg)
    cfg.checkpoint.dir, cfg.checkpoint.load = None, None
    return cfg, ModelShape.of(cfg.model, resolve_vocab_size(cfg, build_tokenizer(cfg.data.tokenizer))), None


def inference_config(ckpt: str | Path, overrides: list[str], for_generation: bool = True):
    """(config, shape, checkpoint path) to load a checkpoint's weights for inference, at the layout the
    overrides give (parallel.tp / pp; the checkpoint reshards). Evaluation (for_generation=False) also
    takes SP and the interleaved schedule."""
    from omegaconf import OmegaConf

    from training import checkpoint
    from training.config.schema import ParallelConfig, to_config

    path = checkpoint.resolve_path(ckpt)
    run = checkpoint.read_run(path)
    saved = to_config({k: v for k, v in run["config"].items() if k != "model"})
    saved.model = checkpoint.saved_model_config(run)
    saved.parallel = ParallelConfig(timeout_minutes=saved.parallel.timeout_minutes)
    try:
        cfg = to_config(OmegaConf.merge(OmegaConf.structured(saved), OmegaConf.from_dotlist(list(overrides))))
    except Exception as err:  # noqa: BLE001 - OmegaConf's refusal of an override, made one line
        from training.config.compose import one_line

        raise ConfigError(one_line(err)) from err
    _inference_layout(cfg, for_generation)
    cfg.checkpoint.dir, cfg.checkpoint.load, cfg.checkpoint.finetune = None, str(path), True
    t = cfg.train  # the run's saving and stopping schedule means nothing here (and needs a checkpoint.dir)
    t.save_interval, t.save_interval_minutes, t.exit_interval, t.exit_duration_minutes = 0, 0.0, 0, 0.0
    return cfg, ModelShape.of(cfg.model, run["vocab_size"]), path


def load_model(cfg, shape: ModelShape, device: torch.device) -> TrainState:
    from training import checkpoint
    from training.parallel.dist import is_rank0

    state = build(cfg, shape, device, init=cfg.checkpoint.load is None, train=False)
    if cfg.checkpoint.load is not None:  # the tools print their results on stdout: this goes to stderr
        checkpoint.maybe_load(cfg, state, lambda message: is_rank0() and print(message, file=sys.stderr, flush=True))
    for chunk in state.model:
        chunk.eval()
    return state


def last_logits(state: TrainState, tokens: torch.Tensor | None, cache: KVCache, batch: int) -> torch.Tensor | None:
    """The full-vocabulary fp32 logits [b, V_padded] of the last position, on the last pipeline stage (None on
    the others); tokens [b, s] (read by the first stage)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    new = tokens.shape[1]

    def step(_, model):  # loss_func None: the schedule keeps the last stage's output
        return model(tokens if unwrap(model).pre_process else None, cache=cache), None

    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=step, data_iterator=None, model=state.model, num_microbatches=1,
            seq_length=new, micro_batch_size=batch, forward_only=True)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    local = outputs[0][:, -1, :].float()  # [b, V_padded/tp]
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        shards = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(shards, local, group=ps.get_tensor_model_parallel_group())
        local = torch.cat(shards, dim=-1)
    return local  # [b, V_padded]: padded rows are -inf (models/gpt.py)


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | Sequence[torch.Generator]) \
        -> torch.Tensor:
    """[b, V] -> [b] token ids. Sampling by the inverse CDF in float64 with one uniform per sequence, so equal
    logits and an equal generator draw equal tokens. generator: one for the batch, or one per sequence (its draws
    then do not depend on which other sequences share the batch: RL's rollouts split over DP ranks)."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.double() / sampling.temperature, dim=-1)  # [b, V]
    probs, order = probs.sort(dim=-1, descending=True)
    if sampling.top_k > 0:
        probs[:, sampling.top_k:] = 0.0
    if sampling.top_p < 1.0:  # drop what lies wholly beyond p (the token that crosses p stays)
        before = probs.cumsum(dim=-1) - probs
        probs[before >= sampling.top_p] = 0.0
    cdf = (probs / probs.sum(dim=-1, keepdim=True)).cumsum(dim=-1)
    if isinstance(generator, torch.Generator):
        u = torch.rand(logits.shape[0], 1, generator=generator, dtype=torch.float64)
    else:  # [b, 1] one uniform from each sequence's own generator
        u = torch.cat([torch.rand(1, 1, generator=g, dtype=torch.float64) for g in generator])
    u = u.to(cdf.device)
    picks = torch.searchsorted(cdf, u).clamp(max=cdf.shape[-1] - 1)  # [b, 1]
    return order.gather(-1, picks).squeeze(-1)


def _share(tokens: torch.Tensor) -> torch.Tensor:
    """The last pipeline stage's tokens [b] to every stage."""
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(tokens, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    return tokens


def generate(state: TrainState, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
             eod: int | Sequence[int], device: torch.device, use_cache: bool = True, on_step=None,
             seeds: Sequence[int] | None = None) -> list[list[int]]:
    """New token ids per prompt (up to and including the first stop id, or max_new_tokens). eod: the id, or the
    ids, that end a sequence (end-of-document; with a chat template also the end of the assistant's turn).
    Every rank calls it and gets the same ids. on_step(step, new_ids [b]) is called on every rank after each
    token. seeds: one per prompt, each sequence sampling from its own generator (the same completion whatever
    else is in the batch); else one generator seeded sampling.seed for the batch."""
    batch, longest = len(prompts), max(len(p) for p in prompts)
    if min(len(p) for p in prompts) == 0:
        raise ConfigError("an empty prompt: give every prompt at least one token")
    total = longest + max_new_tokens
    if total > state.shape.seq_length and state.shape.position_embedding == "learned":
        raise ConfigError(f"prompt ({longest}) + new tokens ({max_new_tokens}) exceed the learned positions "
                          f"(model.seq_length={state.shape.seq_length})")
    pad = torch.tensor([longest - len(p) for p in prompts], device=device)
    tokens = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=device)  # [b, T] left-padded
    generator = torch.Generator().manual_seed(sampling.seed) if seeds is None else \
        [torch.Generator().manual_seed(int(seed)) for seed in seeds]
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    stops = torch.tensor([eod] if isinstance(eod, int) else sorted(set(eod)), dtype=torch.long, device=device)
    new_ids: list[list[int]] = [[] for _ in prompts]
    cache = KVCache(total, pad)
    step_input = tokens
    for step in range(max_new_tokens):
        if not use_cache:  # the reference: every position again, in a fresh cache
            cache, step_input = KVCache(total, pad), tokens
        logits = last_logits(state, step_input, cache, batch)
        picked = sample(logits, sampling, generator) if logits is not None else \
            torch.zeros(batch, dtype=torch.long, device=device)
        picked = _share(picked.to(device))
        for i in range(batch):
            if not done[i]:
                new_ids[i].append(int(picked[i]))
        if on_step is not None:
            on_step(step, picked)
        done |= torch.isin(picked, stops)
        if bool(done.all()):
            break
        tokens = torch.cat([tokens, picked[:, None]], dim=1)  # [b, T + step + 1]
        step_input = picked[:, None]  # [b, 1]: the cache holds the rest
    return new_ids
