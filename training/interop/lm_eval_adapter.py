"""lm-evaluation-harness on a checkpoint, at any TP x PP layout (tools/evaluate.py --tasks's back end).

    lm = CheckpointLM(state, tokenizer, device, max_length=shape.seq_length, batch_size=8)
    results = lm_eval.simple_evaluate(model=lm, tasks=["arc_easy"], task_manager=TaskManager(include_path=DIR))

An lm-eval `TemplateLM` (lm-eval builds the requests from its own task definitions; this answers them) that
mirrors lm-eval's `hf` backend, so both give the same numbers for the same weights and token ids:
- loglikelihood: the last max_length + 1 tokens of context + continuation (minus the last one) right-padded into
  a batch (causal attention keeps padding out of the real positions); the continuation's log-probabilities from
  the last stage's logits, gathered over TP at the continuation's positions only; is_greedy when every
  continuation token is the argmax. An empty context is the end-of-document token (TemplateLM's rule).
- loglikelihood_rolling: lm-eval's rolling windows of max_length tokens (prefix end-of-document), each scored
  as above, summed per document.
- generate_until: training/interop/generation.generate (the KV cache, left-padded batches), greedy unless the task
  asks do_sample; the context left-truncated to max_length - max_gen_toks; the text cut at the first stop string.
Every rank of the one model replica (world = tp x pp) gets every request: lm-eval sees rank 0 of a world of 1 on
each (as its megatron_lm backend does under TP), and the last pipeline stage broadcasts its results to the
other stages, so every rank returns the same values; only global rank 0 prints.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from training.errors import ConfigError
from training.interop.generation import Sampling, generate
from training.parallel.wrap import unwrap


def all_logits(state, tokens: torch.Tensor) -> torch.Tensor | None:
    """tokens [b, s] -> this TP rank's logits [b, s, V_padded/tp] on the last pipeline stage (None on the others),
    through Megatron-Core's pipeline schedule (forward only, one micro-batch)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def step(_, model):  # loss_func None: the schedule keeps the last stage's output
        return model(tokens if unwrap(model).pre_process else None), None

    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=step, data_iterator=None, model=state.model, num_microbatches=1,
            seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0], forward_only=True)
    return outputs[0] if ps.is_pipeline_last_stage(ignore_virtual=True) else None


def from_last_stage(values: torch.Tensor) -> torch.Tensor:
    """The last pipeline stage's tensor to every stage (the others pass a tensor of the same shape)."""
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(values, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    return values


class CheckpointLM(TemplateLM):
    backend = "causal"

    def __init__(self, state, tokenizer, device: torch.device, max_length: int, batch_size: int = 8,
                 max_gen_toks: int = 256, seed: int = 0):
        super().__init__()  # rank 0, world 1: every rank answers every request (one model replica)
        self.state, self.tok, self._device = state, tokenizer, device
        self._max_length, self.batch_size, self.max_gen_toks, self.seed = max_length, batch_size, max_gen_toks, seed
        self.show_progress = os.environ.get("RANK", "0") == "0"

    @property
    def eot_token_id(self) -> int:
        return self.tok.eod

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tok.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string)  # our tokenizers add no special tokens

    def tok_decode(self, ids) -> str:
        """Text of token ids, leaving out end-of-document and the ids of the model's padded vocabulary."""
        return self.tok.decode([i for i in ids if i < self.tok.vocab_size and i != self.tok.eod])

    def _score(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(input ids, continuation ids) per row, the continuation being what the input's last positions predict:
        its log-likelihood and whether greedy decoding gives it."""
        longest = max(len(inp) for inp, _ in rows)
        tokens = torch.tensor([inp + [self.eot_token_id] * (longest - len(inp)) for inp, _ in rows],
                              device=self.device)  # [b, s] right-padded
        logits = all_logits(self.state, tokens)
        result = torch.zeros(len(rows), 2, dtype=torch.float64, device=self.device)  # [b, (log-likelihood, misses)]
        if logits is not None:
            local = torch.cat([logits[i, len(inp) - len(cont):len(inp)] for i, (inp, cont) in enumerate(rows)])
            full = gather_from_tensor_model_parallel_region(local.float())  # [n, V/tp] -> [n, V_padded]
            target = torch.tensor([t for _, cont in rows for t in cont], device=self.device)  # [n]
            owner = torch.repeat_interleave(torch.arange(len(rows), device=self.device),
                                            torch.tensor([len(cont) for _, cont in rows], device=self.device))  # [n]
            log_probs = torch.log_softmax(full, dim=-1).gather(-1, target[:, None]).squeeze(-1)  # [n]
            result[:, 0].index_add_(0, owner, log_probs.double())
            result[:, 1].index_add_(0, owner, (full.argmax(dim=-1) != target).double())
        result = from_last_stage(result)
        return [(ll, misses == 0) for ll, misses in result.tolist()]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) or None, context ids, continuation ids); longest first in batches."""
        from tqdm import tqdm

        rows = []
        for _, context, continuation in requests:
            if not continuation or len(continuation) > self.max_length:
                raise ConfigError(f"a continuation of {len(continuation)} tokens: score 1 to max_length "
                                  f"({self.max_length}, model.seq_length) tokens")
            rows.append(((context + continuation)[-(self.max_length + 1):][:-1], continuation))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        out: list = [None] * len(rows)
        bar = tqdm(total=len(rows), desc="loglikelihood", disable=disable_tqdm or not self.show_progress)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            for i, score in zip(batch, self._score([rows[i] for i in batch])):
                out[i] = score
                if requests[i][0] is not None:  # None: a rolling window (its document is cached whole)
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], score)
            bar.update(len(batch))
        bar.close()
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for k, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(k)
        totals = [0.0] * len(requests)
        for k, (log_likelihood, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[k] += log_likelihood
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Batches of requests with equal generation arguments, longest context first."""
        reorder = Collator([req.args for req in requests], sort_fn=lambda a: (-len(self.tok_encode(a[0])), a[0]),
                           group_by="gen_kwargs", group_fn=lambda a: a[1])
        out = []
        for chunk in reorder.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk)
            kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
            new_tokens = kwargs.pop("max_gen_toks")
            room = self.max_length - new_tokens
            if room < 1:
                raise ConfigError(f"max_gen_toks={new_tokens} leaves no room for a context in max_length="
                                  f"{self.max_length} (model.seq_length): ask the task for fewer new tokens")
            sampling = Sampling(greedy=True) if not kwargs.get("do_sample") else Sampling(
                greedy=False, temperature=float(kwargs.get("temperature") or 1.0), top_k=int(kwargs.get("top_k") or 0),
                top_p=float(kwargs.get("top_p") or 1.0), seed=self.seed)
            prompts = [(self.tok_encode(c) or [self.prefix_token_id])[-room:] for c in contexts]
            new_ids = generate(self.state, prompts, new_tokens, sampling, self.eot_token_id, self.device)
            for context, gen_kwargs, ids in zip(contexts, all_kwargs, new_ids):
                text = postprocess_generated_text(self.tok_decode(ids), until, None)
                out.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return reorder.get_original(out)


def task_manager(tasks: list[str], include_path: list[str]):
    """lm-eval's TaskManager: only the include paths' YAMLs when they define every task asked for (indexing
    lm-eval's ~14,000 own task files takes ~10 s of CPU), else lm-eval's tasks as well."""
    from lm_eval.tasks import TaskManager

    if include_path:
        own = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(own.all_tasks):
            return own
    manager = TaskManager(include_path=include_path or None)
    if unknown := sorted(set(tasks) - set(manager.all_tasks)):
        raise ConfigError(f"--tasks: no task named {', '.join(unknown)} in lm-eval's tasks"
                          + (f" or {', '.join(include_path)}" if include_path else "")
                          + " (list them with `lm-eval ls tasks`; your own: --include-path DIR of task YAMLs)")
    return manager


def run_tasks(args) -> None:
    """In every process: load the checkpoint at the overrides' layout, evaluate args.tasks, print (and write) on
    rank 0."""
    from lm_eval import simple_evaluate
    from lm_eval.utils import handle_non_serializable, make_table

    from training.data.tokenizer import build_tokenizer
    from training.interop.generation import inference_config, load_model
    from training.parallel import dist as D

    cfg, shape, path = inference_config(args.ckpt, args.overrides)
    world, p = int(os.environ.get("WORLD_SIZE", "1")), cfg.parallel
    if world != p.tp * p.pp:
        raise ConfigError(f"--tasks runs one model replica: {world} processes but parallel.tp * pp = {p.tp} * "
                          f"{p.pp} = {p.tp * p.pp} (start tp * pp processes: --nproc {p.tp * p.pp})")
    tasks = [t for t in args.tasks.split(",") if t]
    manager = task_manager(tasks, args.include_path)
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    with D.distributed(**D.layout_of(cfg)) as info:
        if not torch.cuda.is_available():
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        lm = CheckpointLM(load_model(cfg, shape, info.device), tokenizer, info.device, shape.seq_length,
                          args.batch_size, args.max_gen_toks, args.seed)
        try:
            results = simple_evaluate(model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=args.limit,
                                      task_manager=manager, log_samples=args.log_samples,
                                      bootstrap_iters=args.bootstrap_iters, random_seed=args.seed)
        except ConnectionError as err:  # `datasets`: the Hub unreachable, or offline (HF_DATASETS_OFFLINE)
            raise ConfigError(f"--tasks {args.tasks}: a task's dataset could not be fetched ({err}): run it once "
                              f"where the Hugging Face Hub is reachable (the datasets cache, HF_HOME, then serves it "
                              f"offline), or give a task YAML over local files (--include-path)") from None
        if os.environ.get("RANK", "0") != "0":
            return
        results["config"].update(checkpoint=str(path), layout=f"tp {p.tp} pp {p.pp}", max_length=shape.seq_length)
        if args.output:
            with open(args.output, "w") as f:
                json.dump(results, f, default=handle_non_serializable, indent=1)
        if args.json:
            print(json.dumps({"results": results["results"], "checkpoint": str(path), "layout": f"tp {p.tp} pp "
                              f"{p.pp}"}, default=handle_non_serializable), flush=True)
        else:
            print(make_table(results), file=sys.stdout, flush=True)
