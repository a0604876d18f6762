"""A LoRA run's adapters as a Hugging Face PEFT adapter (tools/convert_hf.py export --adapter), or merged into
the base weights (export --merge), from a single-process model (tp1, pp1: the checkpoint was resharded on load).

    <out>/adapter_config.json          peft_type LORA, r, lora_alpha (PEFT's scale is lora_alpha / r, as ours),
                                       lora_dropout, target_modules, base_model_name_or_path
    <out>/adapter_model.safetensors    base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight, ...

Our adapter on the fused QKV is one A [r, h] shared by q, k and v, and one B over the fused rows; PEFT puts a
LoRA on each of q_proj, k_proj and v_proj. The same function exactly: q's LoRA is A with B's q rows, k's A with
B's k rows, v's A with B's v rows (B's rows split as attention's own weight is: models/attention.py to_hf), since
scale * B A x restricted to q's rows is scale * B_q A x. The same for fc1's gate|up (gate_proj, up_proj: B's two
halves) under SwiGLU. Canonical LoRA (models/lora_split.py: peft.targets linear_q, linear_k, linear_v,
linear_fc1_gate, linear_fc1_up) has PEFT's own layout, an A and a B per projection: each is written as it is.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from models.layer import hf_names
from models.lora import Adaptable
from models.lora_split import merged_delta, parts
from training.interop.hf_config import HFError
from training.parallel.peft import SPLIT
from training.parallel.wrap import unwrap

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# our adapted linear -> the HF projections it stands for (the fused ones: several, sharing A)
PROJECTIONS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
               "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
# a canonical (per-part) adapter's target -> its HF projection: linear_q -> q_proj, ..., linear_fc1_up -> up_proj
PART_PROJECTION = {part: proj for linear, split in SPLIT.items() for part, proj in zip(split, PROJECTIONS[linear])}


def adapted(state) -> list[tuple[str, Adaptable]]:
    """(name, linear) for every linear of the single-process model that carries an adapter (fused or per part)."""
    return [(n, m) for n, m in unwrap(state.model[0]).named_modules()
            if isinstance(m, Adaptable) and (m.has_lora or parts(m))]


def _split_b(linear: str, b: torch.Tensor, config) -> list[torch.Tensor]:
    """B's rows per HF projection: QKV's interleaved [ng, (np/ng)*hn q | hn k | hn v] rows; fc1's gate|up."""
    if linear == "linear_qkv":
        ng, hn = config.num_query_groups, config.kv_channels
        per_group = config.num_attention_heads // ng * hn
        return [t.flatten(0, 1) for t in b.reshape(ng, per_group + 2 * hn, -1).split([per_group, hn, hn], dim=1)]
    if linear == "linear_fc1":
        if not config.gated_linear_unit:
            raise HFError("an adapter on a non-gated MLP's fc1 has no Llama-family (gate_proj / up_proj) name")
        return list(torch.chunk(b, 2, dim=0))
    return [b]


def adapter_tensors(state) -> dict[str, torch.Tensor]:
    """PEFT's tensor names -> the adapters (A repeated and B split for the fused q/k/v and gate/up)."""
    gpt, out = unwrap(state.model[0]), {}
    names = hf_names(state.shape)
    for name, module in adapted(state):
        if ".local_experts." in name:  # transformers >= 5 holds a MoE's experts fused, not as linears PEFT adapts
            raise HFError(f"{name}: an expert's adapter has no PEFT export here (transformers keeps the experts fused "
                          f"in one tensor, which PEFT adapts only by target_parameters): export --merge")
        found = re.fullmatch(r"decoder\.layers\.(\d+)\.(\w+)\.(\w+)", name)
        if found is None or found[2] not in names or found[3] not in PROJECTIONS:
            raise HFError(f"{name}: its adapter has no Hugging Face PEFT name (a layer's self_attention / mlp "
                          f"linears only: {sorted(PROJECTIONS)})")
        layer, block, linear = found.groups()
        prefix = f"base_model.model.model.layers.{layer}.{names[block]}."
        for part, adapter in parts(module):  # canonical: PEFT's own A and B per projection
            out[f"{prefix}{PART_PROJECTION[part]}.lora_A.weight"] = adapter.lora_a.detach().clone().contiguous()
            out[f"{prefix}{PART_PROJECTION[part]}.lora_B.weight"] = adapter.lora_b.detach().clone().contiguous()
        if not module.has_lora:
            continue
        for proj, b in zip(PROJECTIONS[linear], _split_b(linear, module.lora_b.detach(), gpt.config), strict=True):
            out[f"{prefix}{proj}.lora_A.weight"] = module.lora_a.detach().clone().contiguous()
            out[f"{prefix}{proj}.lora_B.weight"] = b.clone().contiguous()
    return out


def write_adapter(state, peft_cfg, out: Path, base_model: str | None) -> int:
    """adapter_config.json + adapter_model.safetensors into `out`; returns the tensors' bytes."""
    from safetensors.torch import save_file

    if list(peft_cfg.trainable):
        raise HFError(f"the run also trained peft.trainable={list(peft_cfg.trainable)}, which a PEFT LoRA adapter "
                      f"does not hold: export --merge (the whole fine-tuned model)")
    tensors = adapter_tensors(state)
    targets = sorted({key.split(".")[-3] for key in tensors})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": int(peft_cfg.rank), "lora_alpha": float(peft_cfg.alpha), "lora_dropout": float(peft_cfg.dropout),
              "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
              "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None}
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return sum(t.nbytes for t in tensors.values())


def merge(state):
    """W += (alpha / r) B A in every adapted linear (computed in fp32), B zeroed (the forward is the same up to
    rounding); returns a function that restores W and B exactly (export --merge --check compares the written
    merged model with the model as it was trained, not with itself)."""
    bs = lambda m: [m.lora_b] if m.has_lora else [a.lora_b for _, a in parts(m)]  # noqa: E731
    saved = [(m, m.weight.detach().clone(), [b.detach().clone() for b in bs(m)]) for _, m in adapted(state)]
    with torch.no_grad():
        for m, _, _ in saved:  # canonical: each part's B_i A_i on its rows of the fused weight
            delta = m.lora_scale * (m.lora_b.float() @ m.lora_a.float()) if m.has_lora else merged_delta(m)
            m.weight.copy_((m.weight.float() + delta).to(m.weight.dtype))
            for b in bs(m):
                b.zero_()

    def restore() -> None:
        with torch.no_grad():
            for m, weight, b_saved in saved:
                m.weight.copy_(weight)
                for b, value in zip(bs(m), b_saved):
                    b.copy_(value)

    return restore


def peft_logits(base_dir: str | Path, adapter_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' base model with the adapter through peft.PeftModel: logits [b, s, V] (fp32)."""
    import transformers
    from peft import PeftModel

    dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), **{dtype_key: torch.float32})
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits.float()
