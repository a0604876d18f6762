"""A Hugging Face PEFT LoRA adapter trained elsewhere onto an imported base checkpoint (tools/convert_hf.py
import --adapter DIR --base CKPT --out OUT): written as our adapters-only checkpoint on that base, so training
continues from it (checkpoint.load=OUT checkpoint.finetune=true) or tools/generate.py runs it.

The inverse of training/interop/peft_export.py's mapping: q_proj / k_proj / v_proj's B rows interleaved back
into the fused QKV's rows (attention's own layout), gate_proj / up_proj's B stacked as fc1's gate|up. Our fused
linear has one A; PEFT's three (two) projections have their own, so an adapter loads only where they are
equal (as our export writes them); a PEFT adapter with different A's is refused (separate q/k/v adapters,
Megatron-Bridge's "canonical LoRA", are not built here).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from models.layer import hf_names
from training.interop.hf_config import HFError
from training.interop.peft_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PROJECTIONS, adapted
from training.parallel.wrap import unwrap

# adapter_config.json keys whose non-default values change the adapter's function (we would load it wrong)
UNSUPPORTED = {"use_dora": False, "use_rslora": False, "bias": "none", "modules_to_save": None, "rank_pattern": {},
               "alpha_pattern": {}, "fan_in_fan_out": False, "layers_to_transform": None}


def read_config(adapter_dir: Path) -> dict:
    """adapter_config.json, checked: a plain LoRA (no DoRA, rsLoRA, per-module ranks, biases, extra modules)."""
    if not (adapter_dir / ADAPTER_CONFIG).is_file() or not (adapter_dir / ADAPTER_WEIGHTS).is_file():
        raise HFError(f"--adapter {adapter_dir} has no {ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}: point it at a Hugging "
                      f"Face PEFT LoRA adapter directory")
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    if config.get("peft_type") != "LORA":
        raise HFError(f"{adapter_dir}: peft_type={config.get('peft_type')!r}, only LORA adapters import")
    bad = {k: config[k] for k, default in UNSUPPORTED.items() if config.get(k, default) not in (default, [], {}, None)
           or (k == "bias" and config.get(k, default) != "none")}
    if bad:
        raise HFError(f"{adapter_dir}: {bad} is not a plain LoRA our adapters express (set as {UNSUPPORTED})")
    return config


def targets(projections: set[str]) -> list[str]:
    """Our peft.targets for PEFT's target projections; a fused linear needs all of its projections."""
    out = []
    for linear, projs in PROJECTIONS.items():
        present = [p for p in projs if p in projections]
        if present and len(present) != len(projs):
            raise HFError(f"the adapter targets {present} but not {sorted(set(projs) - set(present))}: our {linear} "
                          f"is one fused linear with one adapter (adapt all of {list(projs)} or none)")
        out += [linear] if present else []
    if unknown := sorted(projections - {p for projs in PROJECTIONS.values() for p in projs}):
        raise HFError(f"the adapter targets {unknown}, which have no adapter here (ours: {sorted(PROJECTIONS)})")
    return out


def fuse_b(linear: str, parts: list[torch.Tensor], config) -> torch.Tensor:
    """B's per-projection rows -> the fused linear's B (peft_export._split_b's inverse)."""
    if linear == "linear_qkv":
        ng, hn = config.num_query_groups, config.kv_channels
        q, k, v = (t.reshape(ng, -1, t.shape[-1]) for t in parts)
        return torch.cat([q, k, v], dim=1).flatten(0, 1)
    return torch.cat(parts, dim=0)


def load_adapter(state, tensors: dict[str, torch.Tensor]) -> int:
    """PEFT's tensors into the single-process model's adapters (every adapter must be given, every tensor
    used); returns the elements set. Different A's for a fused linear's projections: refused."""
    gpt, names, used, count = unwrap(state.model[0]), hf_names(state.shape), set(), 0
    for name, module in adapted(state):
        layer, block, linear = re.fullmatch(r"decoder\.layers\.(\d+)\.(\w+)\.(\w+)", name).groups()
        prefix = f"base_model.model.model.layers.{layer}.{names[block]}."
        keys = [(f"{prefix}{p}.lora_A.weight", f"{prefix}{p}.lora_B.weight") for p in PROJECTIONS[linear]]
        if missing := [k for pair in keys for k in pair if k not in tensors]:
            raise HFError(f"the adapter has no {missing[0]} (our {name} needs it)")
        a = [tensors[ka] for ka, _ in keys]
        if any(not torch.equal(a[0], other) for other in a[1:]):
            raise HFError(f"{prefix}{'/'.join(PROJECTIONS[linear])}: different lora_A matrices, which our fused "
                          f"{linear} (one A) cannot hold; separate q/k/v and gate/up adapters are not built here")
        b = fuse_b(linear, [tensors[kb] for _, kb in keys], gpt.config)
        for param, value in ((module.lora_a, a[0]), (module.lora_b, b)):
            if tuple(param.shape) != tuple(value.shape):
                raise HFError(f"{name}: the adapter's {tuple(value.shape)} does not fit {tuple(param.shape)} "
                              f"(another base model, or another rank?)")
            with torch.no_grad():
                param.copy_(value)
            count += value.numel()
        used |= {k for pair in keys for k in pair}
    if unused := sorted(set(tensors) - used):
        raise HFError(f"adapter tensors with no place in the model: {unused[:4]}")
    return count


def import_adapter(args, overrides: list[str]) -> bool:
    """convert_hf import --adapter DIR --base CKPT --out OUT: OUT/iter_0000000 holds the adapters only, its
    run.json names the base (training/config/checkpoint_match.py)."""
    from safetensors.torch import load_file

    from models.shape import ModelShape
    from training import checkpoint
    from training.config.schema import ParallelConfig, to_config
    from training.engine.build import build
    from training.errors import TemplateError
    from training.parallel import dist as D

    if overrides or args.hf_dir:
        raise TemplateError(f"import --adapter takes no --hf-dir or overrides (the base checkpoint's run.json "
                            f"defines the model): {[*overrides, *(['--hf-dir'] if args.hf_dir else [])]}")
    if not args.base:
        raise TemplateError("import --adapter needs --base CKPT: the checkpoint convert_hf import wrote for the "
                            "adapter's base model")
    adapter_dir, base = Path(args.adapter), checkpoint.resolve_path(args.base)
    config = read_config(adapter_dir)
    tensors = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    run = checkpoint.read_run(base)
    if run.get("peft_base") or str(run["config"].get("peft", {}).get("method", "none")) != "none":
        raise TemplateError(f"--base {base} holds LoRA adapters: give the base model's checkpoint (convert_hf import)")
    cfg = to_config(run["config"])
    cfg.parallel = ParallelConfig(timeout_minutes=cfg.parallel.timeout_minutes)
    cfg.peft.method, cfg.peft.rank, cfg.peft.alpha = "lora", int(config["r"]), float(config["lora_alpha"])
    cfg.peft.dropout, cfg.peft.trainable = float(config.get("lora_dropout") or 0.0), []
    cfg.peft.targets = targets({key.split(".")[-3] for key in tensors})
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise TemplateError(f"--out {out} is not empty: choose a new directory (nothing is overwritten)")
    cfg.checkpoint.dir, cfg.checkpoint.load, cfg.checkpoint.finetune = str(out.resolve()), str(base), True
    with D.distributed(tp=1, pp=1, seed=cfg.train.seed, timeout_minutes=cfg.parallel.timeout_minutes) as info:
        state = build(cfg, ModelShape.of(cfg.model, run["vocab_size"]), info.device, init=False, train=False)
        checkpoint.maybe_load(cfg, state)  # the base's weights (the adapters are set below)
        count = load_adapter(state, tensors)
        checkpoint.save(cfg, state, iteration=0, consumed_samples=0, model_only=True)
    print(f"imported the PEFT adapter {adapter_dir} ({count / 1e3:.1f}K adapter parameters, r={cfg.peft.rank}, "
          f"alpha={cfg.peft.alpha:g}, targets {list(cfg.peft.targets)}) on {base}: {out}\ncontinue training with: "
          f"peft=lora peft.rank={cfg.peft.rank} peft.alpha={cfg.peft.alpha:g} "
          f"'peft.targets=[{','.join(cfg.peft.targets)}]' checkpoint.load={out} checkpoint.finetune=true", flush=True)
    return True
