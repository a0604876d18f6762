"""A Hugging Face PEFT LoRA adapter trained elsewhere onto an imported base checkpoint (tools/convert_hf.py
import --adapter DIR --base CKPT --out OUT): written as our adapters-only checkpoint on that base, so training
continues from it (checkpoint.load=OUT checkpoint.finetune=true) or tools/generate.py runs it.

The inverse of training/interop/peft_export.py's mapping: q_proj / k_proj / v_proj's B rows interleaved back
into the fused QKV's rows (attention's own layout), gate_proj / up_proj's B stacked as fc1's gate|up, where the
projections' A's are equal (as our export of the fused form writes them: one A). Where they differ (an adapter
trained elsewhere), or only some of a fused linear's projections are adapted (PEFT's q_proj + v_proj), or
the override peft.targets names the parts, the adapter imports as canonical LoRA (models/lora_split.py: an A
and a B per projection, targets linear_q / linear_k / linear_v, linear_fc1_gate / linear_fc1_up), exactly.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from models.layer import hf_names
from training.interop.hf_config import HFError
from models.lora_split import parts
from training.interop.peft_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PART_PROJECTION, PROJECTIONS, adapted
from training.parallel.peft import SPLIT
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


def _a_differ(tensors: dict[str, torch.Tensor], projs: list[str]) -> bool:
    """Whether any layer's lora_A of these projections differ (one fused A cannot hold them)."""
    by_layer: dict[str, list[torch.Tensor]] = {}
    for key, value in tensors.items():
        head, _, proj = key.removesuffix(".lora_A.weight").rpartition(".")
        if key.endswith(".lora_A.weight") and proj in projs:
            by_layer.setdefault(head, []).append(value)
    return any(not torch.equal(a[0], other) for a in by_layer.values() for other in a[1:])


def targets(tensors: dict[str, torch.Tensor], wanted: list[str] | None = None) -> tuple[list[str], list[str]]:
    """Our peft.targets for PEFT's tensors, and why each fused linear took its form: fused (one A) where its
    projections' A's are equal, canonical (an A per projection) where they differ, where only some projections
    are adapted, or where `wanted` (the override peft.targets) names the parts."""
    projections, out, why = {key.split(".")[-3] for key in tensors}, [], []
    if unknown := sorted(projections - {p for projs in PROJECTIONS.values() for p in projs}):
        raise HFError(f"the adapter targets {unknown}, which have no adapter here (ours: {sorted(PROJECTIONS)})")
    for linear, projs in PROJECTIONS.items():
        present = [p for p in projs if p in projections]
        if not present or linear not in SPLIT:
            out += [linear] if present else []
            continue
        named = [part for part, proj in zip(SPLIT[linear], projs) if proj in present]
        reason = ("only " + ", ".join(present) + " adapted" if len(present) < len(projs) else
                  "lora_A of " + ", ".join(present) + " differ" if _a_differ(tensors, present) else
                  "peft.targets names them" if wanted and set(named) & set(wanted) else None)
        out += named if reason else [linear]
        why.append(f"{linear} as {named} ({reason})" if reason else f"{linear} fused ({', '.join(present)} share one "
                                                                    f"lora_A)")
    if wanted is not None and sorted(wanted) != sorted(out):
        raise HFError(f"peft.targets={wanted} does not fit the adapter ({'; '.join(why)}): give {out} or leave "
                      f"peft.targets out")
    return out, why


def fuse_b(linear: str, pieces: list[torch.Tensor], config) -> torch.Tensor:
    """B's per-projection rows -> the fused linear's B (peft_export._split_b's inverse)."""
    if linear == "linear_qkv":
        ng = config.num_query_groups
        q, k, v = (t.reshape(ng, -1, t.shape[-1]) for t in pieces)
        return torch.cat([q, k, v], dim=1).flatten(0, 1)
    return torch.cat(pieces, dim=0)


def load_adapter(state, tensors: dict[str, torch.Tensor]) -> int:
    """PEFT's tensors into the single-process model's adapters (every adapter must be given, every tensor
    used); returns the elements set. Different A's for a fused linear's projections: refused."""
    gpt, names, used, count = unwrap(state.model[0]), hf_names(state.shape), set(), 0
    for name, module in adapted(state):
        layer, block, linear = re.fullmatch(r"decoder\.layers\.(\d+)\.(\w+)\.(\w+)", name).groups()
        prefix = f"base_model.model.model.layers.{layer}.{names[block]}."
        if split := parts(module):  # canonical: each projection's A and B as they are
            into = [(f"{name}.{part}", param, f"{prefix}{PART_PROJECTION[part]}.lora_{x}.weight")
                    for part, adapter in split for x, param in (("A", adapter.lora_a), ("B", adapter.lora_b))]
            count += _copy(tensors, into)
            used |= {key for _, _, key in into}
            continue
        keys = [(f"{prefix}{p}.lora_A.weight", f"{prefix}{p}.lora_B.weight") for p in PROJECTIONS[linear]]
        if missing := [k for pair in keys for k in pair if k not in tensors]:
            raise HFError(f"the adapter has no {missing[0]} (our {name} needs it)")
        a = [tensors[ka] for ka, _ in keys]
        if any(not torch.equal(a[0], other) for other in a[1:]):
            raise HFError(f"{prefix}{'/'.join(PROJECTIONS[linear])}: different lora_A matrices, which our fused "
                          f"{linear} (one A) cannot hold: import it with peft.targets={list(SPLIT[linear])}")
        b = fuse_b(linear, [tensors[kb] for _, kb in keys], gpt.config)
        count += _copy({"A": a[0], "B": b}, [(name, module.lora_a, "A"), (name, module.lora_b, "B")])
        used |= {k for pair in keys for k in pair}
    if unused := sorted(set(tensors) - used):
        raise HFError(f"adapter tensors with no place in the model: {unused[:4]}")
    return count


def _copy(values: dict[str, torch.Tensor], into: list[tuple[str, torch.nn.Parameter, str]]) -> int:
    """values[key] into each (our name, param, key); refused where missing or of another shape."""
    for name, param, key in into:
        if key not in values:
            raise HFError(f"the adapter has no {key} (our {name} needs it)")
        if tuple(param.shape) != tuple(values[key].shape):
            raise HFError(f"{name}: the adapter's {tuple(values[key].shape)} does not fit {tuple(param.shape)} "
                          f"(another base model, or another rank?)")
        with torch.no_grad():
            param.copy_(values[key])
    return sum(param.numel() for _, param, _ in into)


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

    wanted = [o for o in overrides if o.startswith("peft.targets=")]  # canonical on demand (targets())
    if len(wanted) != len(overrides) or len(wanted) > 1 or args.hf_dir:
        raise TemplateError(f"import --adapter takes no --hf-dir or overrides but peft.targets (the base checkpoint's "
                            f"run.json defines the model): {[*overrides, *(['--hf-dir'] if args.hf_dir else [])]}")
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
    names = [t.strip(" '\"") for t in wanted[0].split("=", 1)[1].strip("[]").split(",")] if wanted else None
    cfg.peft.targets, why = targets(tensors, names)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise TemplateError(f"--out {out} is not empty: choose a new directory (nothing is overwritten)")
    cfg.checkpoint.dir, cfg.checkpoint.load, cfg.checkpoint.finetune = str(out.resolve()), str(base), True
    with D.distributed(tp=1, pp=1, seed=cfg.train.seed, timeout_minutes=cfg.parallel.timeout_minutes) as info:
        state = build(cfg, ModelShape.of(cfg.model, run["vocab_size"]), info.device, init=False, train=False)
        checkpoint.maybe_load(cfg, state)  # the base's weights (the adapters are set below)
        count = load_adapter(state, tensors)
        checkpoint.save(cfg, state, iteration=0, consumed_samples=0, model_only=True)
    form = "; ".join(why) or "no q/k/v or gate/up projections"  # fused or canonical, and why
    tokenizer = f" data.tokenizer={cfg.data.tokenizer}" if cfg.data.tokenizer != "byte" else ""
    dropout = f" peft.dropout={cfg.peft.dropout:g}" if cfg.peft.dropout else ""
    print(f"imported the PEFT adapter {adapter_dir} ({count / 1e3:.1f}K adapter parameters, r={cfg.peft.rank}, "
          f"alpha={cfg.peft.alpha:g}, targets {list(cfg.peft.targets)}: {form}) on {base}: {out}\n"
          f"continue training with: {model_selection(cfg.model.name)} "
          f"peft=lora peft.rank={cfg.peft.rank} peft.alpha={cfg.peft.alpha:g}{dropout} "
          f"'peft.targets=[{','.join(cfg.peft.targets)}]' checkpoint.load={out} checkpoint.finetune=true{tokenizer}",
          flush=True)
    return True


def model_selection(name: str) -> str:
    """model=local/NAME (where convert_hf import writes a preset) or model=NAME (a shipped preset) for the base's
    model; else a placeholder that says where it comes from."""
    presets = Path(__file__).resolve().parents[2] / "conf" / "model"
    if (presets / "local" / f"{name}.yaml").is_file():
        return f"model=local/{name}"
    if (presets / f"{name}.yaml").is_file():
        return f"model={name}"
    return f"model=<the base's preset: {name}, as convert_hf import printed it>"
