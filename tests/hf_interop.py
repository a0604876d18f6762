"""Shared by tests/test_convert_hf.py and tests/test_convert_hf_families.py: the small HF architecture, tools/
convert_hf.py's main() run in-process, the --check line's number, and a checkpoint's logits at other layouts.

    ARCH, VOCAB, TOLERANCE              the random HF Llama's config.json fields; the logits tolerance
    convert_main(convert_hf, argv)      (exit code, stdout, stderr) of tools/convert_hf.py main(argv)
    relative_diff(output)               the relative logits difference printed by --check
    meta_parameter_count(cls, config)   transformers' parameter count for a published config.json (meta device)
    logits_at_layouts(jobs, tokens)     run_distributed worker: each checkpoint's gathered logits at a layout
"""

import contextlib
import io
import os
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 301
TOLERANCE = 1e-4
ARCH = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=5e5, rms_norm_eps=1e-6, max_position_embeddings=128)


def convert_main(convert_hf, argv: list[str]) -> tuple[int, str, str]:
    """tools/convert_hf.py main(argv) in this process: (exit code, stdout, stderr). It sets RANK / WORLD_SIZE (a
    world of one) for its own process group: the environment is restored, or a later test's tool would think it
    runs under torchrun with one process."""
    out, err, saved = io.StringIO(), io.StringIO(), dict(os.environ)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = convert_hf.main(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return code, out.getvalue(), err.getvalue()


def relative_diff(output: str) -> float:
    """The relative logits difference a --check line reports."""
    (value,) = re.findall(r"relative to max \|logit\| [0-9.]+: ([0-9.e+-]+)", output)
    return float(value)


# greedy decoding checks: two prompts (19 bytes and 2) and 24 new tokens, past a window of 16
PROMPTS = [[84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110, 32, 102, 111, 120], [72, 105]]
NEW = 24


def hf_greedy(model) -> list[list[int]]:
    """transformers' greedy continuation (generate(), NEW tokens) of each of PROMPTS, by `model` in eval mode."""
    model.eval()
    return [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
            [0, len(p):].tolist() for p in PROMPTS]


def greedy_at_tp2(root: str, names) -> dict:
    """{name: greedy continuations of PROMPTS} of each imported checkpoint {root}/ckpt_{name}, at tp2 (in a
    2-process group; the model-parallel state is rebuilt per checkpoint)."""
    from megatron.core import parallel_state

    from training.interop.generation import Sampling, generate, inference_config, load_model
    from training.parallel import dist as D

    out = {}
    for name in names:
        cfg, shape, _ = inference_config(f"{root}/ckpt_{name}", ["parallel.tp=2"])
        info = D.init(**{**D.layout_of(cfg), "timeout_minutes": 2})
        state = load_model(cfg, shape, info.device)
        out[name] = generate(state, PROMPTS, NEW, Sampling(greedy=True), eod=-1, device=info.device)
        parallel_state.destroy_model_parallel()
    D.teardown()
    return out


def meta_parameter_count(config_class: str, published: dict) -> int:
    """The parameter count of transformers' model for a published config.json (class name config_class), built on
    the meta device (tied: the embedding once)."""
    import transformers

    config = getattr(transformers, config_class)(**published)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def logits_at_layouts(jobs: list[tuple[str, str, str, list[str]]], tokens: torch.Tensor) -> dict:
    """For each (label, preset dir, checkpoint, overrides): load the checkpoint's weights at that layout (one
    2-process group; the model-parallel state is rebuilt per job) and return the gathered logits, if any."""
    from megatron.core import parallel_state

    from models.shape import ModelShape
    from training import checkpoint
    from training.config.compose import compose
    from training.engine.build import build
    from training.interop import hf
    from training.parallel import dist as D

    out = {}
    for label, conf, ckpt, overrides in jobs:
        cfg = compose([f"hydra.searchpath=[file://{conf}]", *overrides, "checkpoint.dir=null",
                       f"checkpoint.load={ckpt}", "checkpoint.finetune=true"])
        info = D.init(**{**D.layout_of(cfg), "timeout_minutes": 2})
        state = build(cfg, ModelShape.of(cfg.model), info.device)
        checkpoint.maybe_load(cfg, state)
        logits = hf.full_logits(state, tokens, cfg.model.vocab_size)
        if logits is not None:  # the last pipeline stage
            out[label] = logits
        parallel_state.destroy_model_parallel()
    D.teardown()
    return out


def hf_named_grads(state) -> dict:
    """The gradients of a single-process model in HF names (the export path's): each weight's .grad put in its
    place for the export, then the weights restored."""
    import torch

    from training.interop.hf import hf_tensors
    from training.parallel.wrap import unwrap

    gpt = unwrap(state.model[0])
    saved = {name: p.detach().clone() for name, p in gpt.named_parameters()}
    with torch.no_grad():
        for p in gpt.parameters():
            p.copy_(p.grad)
    grads = {name: t.clone() for name, t in hf_tensors(state)}
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            p.copy_(saved[name])
    return grads
