"""The logits check of tools/convert_hf.py in bounded memory: both models built with their parameters on the meta
device, each module's own parameters made real (fp32) just before its forward and dropped after it. Peak memory:
one module's weights per model (the largest is the embedding or the output layer) plus the activations of the
check's few tokens, whatever the model's size.

    ours:         the template model from a checkpoint directory (the params each module owns read with
                  dist_checkpointing, any dtype into fp32: one load per module);
    transformers: the Hugging Face model from config.json, its modules' params read from the safetensors by
                  their module names. A checkpoint whose tensor names are not its modules' (transformers 5's fused
                  MoE experts convert per-expert tensors on load) is checked with the whole model loaded, and the
                  output line says so.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch

from training.parallel.wrap import unwrap


@contextlib.contextmanager
def params_on_meta():
    """Modules built inside get their parameters on the meta device, their buffers (RoPE's inv_freq) real
    (accelerate's init_empty_weights(include_buffers=False), without the dependency)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            kind = type(param)
            module._parameters[name] = kind(param.to("meta"), **({"requires_grad": param.requires_grad}
                                                                 if kind is torch.nn.Parameter else {}))
            module._parameters[name].__dict__.update(param.__dict__)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def stream_parameters(model: torch.nn.Module, read, keep: set[str] = frozenset()) -> list:
    """Forward hooks on every module that owns parameters: before its forward, read(module name, parameter
    name, meta param) -> the real tensor (fp32) for each, and for its persistent buffers (None: keep it); after
    it, the parameters back to meta (modules named in `keep` stay
    real: a tied embedding the output layer reads later). Returns the hook handles."""
    handles = []
    for prefix, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue

        def load(mod, *_, prefix=prefix):
            for name, param in list(mod.named_parameters(recurse=False)):
                if param.is_meta:
                    real = torch.nn.Parameter(read(prefix, name, param).float(), requires_grad=False)
                    real.__dict__.update(param.__dict__)
                    mod._parameters[name] = real
            for name in [n for n, b in mod._buffers.items() if b is not None and n not in
                         mod._non_persistent_buffers_set]:  # DeepSeek's router expert bias (kept once read)
                if (value := read(prefix, name, mod._buffers[name])) is not None:
                    mod._buffers[name] = value.float()

        def drop(mod, *_, prefix=prefix):
            if prefix not in keep:
                for name, param in list(mod.named_parameters(recurse=False)):
                    meta = torch.nn.Parameter(param.to("meta"), requires_grad=False)
                    meta.__dict__.update(param.__dict__)
                    mod._parameters[name] = meta

        handles += [module.register_forward_pre_hook(load), module.register_forward_hook(drop)]
    return handles


def our_logits(cfg, shape, path: Path, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The template model's logits [b, s, V] (fp32, tp1) for `tokens`, its modules' weights read from checkpoint
    `path` one module at a time (saved in any dtype, computed in fp32)."""
    from training.interop import hf
    from training.interop.ckpt_reader import CheckpointReader, meta_model

    cfg = copy.deepcopy(cfg)
    cfg.train.precision = "fp32"
    state = meta_model(cfg, shape)
    reader = CheckpointReader(cfg, state, path)
    tied = {"embedding.word_embeddings"} if shape.tie_embeddings else set()
    handles = stream_parameters(unwrap(state.model[0]), lambda prefix, name, _: reader(
        f"{prefix}.{name}" if prefix else name, torch.float32), keep=tied)
    try:
        return hf.full_logits(state, tokens, vocab_size).cpu()
    finally:
        for handle in handles:
            handle.remove()


def reference_logits(hf_dir: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, str]:
    """transformers' logits [b, s, V] (fp32) of an HF directory, its modules' weights read one module at a time;
    (logits, what was done)."""
    import transformers

    from training.interop import hf

    weights = hf.HFWeights(hf_dir)
    config = transformers.AutoConfig.from_pretrained(str(hf_dir))
    config._attn_implementation = "eager"  # the oracle (Gemma 2's soft-cap needs it)
    with params_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    tied = getattr(config, "tie_word_embeddings", False)
    alias = {"lm_head.weight": "model.embed_tokens.weight"} if tied and "lm_head.weight" not in weights.where else {}
    if missing := [n for n in names if alias.get(n, n) not in weights]:
        return hf.reference_logits(hf_dir, tokens), (f"whole model loaded (its parameter names are not the "
                                                     f"checkpoint's tensor names, e.g. {missing[0]})")

    def read(prefix: str, name: str, param) -> torch.Tensor | None:
        key = f"{prefix}.{name}" if prefix else name
        if not isinstance(param, torch.nn.Parameter) and alias.get(key, key) not in weights.where:
            return None  # a buffer the checkpoint does not hold: the model's own
        return weights(alias.get(key, key))

    handles = stream_parameters(model, read)
    try:
        with torch.no_grad():
            return model.eval()(input_ids=tokens).logits.float(), "module by module"
    finally:
        for handle in handles:
            handle.remove()


def report(ours: torch.Tensor, reference: torch.Tensor, precision: str, tolerance: float | None,
           how: str | None = None) -> bool:
    """Print the logits check's line (max |diff|, the same relative to max |logit|, what was compared); True
    when within tolerance (default: fp32 1e-4, bf16 5e-2)."""
    from training.interop import hf

    worst, relative = hf.logits_diff(ours, reference)
    limit = tolerance if tolerance is not None else hf.BF16_TOLERANCE if precision == "bf16" else hf.FP32_TOLERANCE
    ok = relative <= limit
    print(f"logits check ({tuple(ours.shape[:2])} tokens, {precision}{', ' + how if how else ''}): max |diff| "
          f"{worst:.3e}, relative to max |logit| {reference.abs().max().item():.3f}: {relative:.3e} (tolerance "
          f"{limit:g}) -> {'ok' if ok else 'FAILED'}", flush=True)
    return ok


def check_checkpoint(cfg, shape, path: Path, hf_dir: Path, tolerance: float | None) -> bool:
    """Our checkpoint `path` against the Hugging Face directory, both streamed module by module, in fp32 (the
    same weights on both sides whatever dtype they are stored in): report()'s verdict."""
    from training.interop import hf

    tokens = hf.check_tokens(shape.vocab_size, cfg.model.seq_length)
    ours = our_logits(cfg, shape, path, tokens, shape.vocab_size)
    reference, how = reference_logits(hf_dir, tokens)
    return report(ours, reference, "fp32", tolerance, f"ours module by module, transformers' {how}")
