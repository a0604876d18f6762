"""The learning rates a run gets when its config leaves `optim.lr` / `optim.min_lr` null: they follow the run.

A model trained from scratch, a full fine-tune of a checkpoint's weights (`checkpoint.finetune=true`) and a LoRA
run (`peft=lora`) want peak learning rates three orders of magnitude apart: the tiny default model learns at 3e-3,
a real Llama fine-tuned at that rate forgets what it knew in a few steps. The anchors:

    run kind        ours    Megatron-Bridge (recipes/llama/llama3.py *_finetune_config)   torchtune (llama3_2/*.yaml)
    pretraining     3e-3    -  (its 1B+ pretraining recipes: 3e-4)                          -
    full fine-tune  5e-6    5e-6 ("Full SFT (peft=None): LR=5e-6")                          2e-5 (1B_full)
    LoRA            1e-4    1e-4 ("LoRA (default): LR=1e-4, dim=8, alpha=16")               3e-4 (1B_lora)

The minimum (the end of the decay) is `optim.lr / 10` unless `optim.min_lr` is given, so `optim.lr=1e-5` alone
is always a valid schedule. Everything that reads a learning rate (training/engine/bridge.py, the validation, the
config line) asks this module; the saved config keeps the nulls, so a resumed run resolves them the same way.
"""

from __future__ import annotations

from training.config.schema import Config

PRETRAIN_LR = 3e-3  # the embedded tiny model from scratch; a 1B+ model from scratch wants ~3e-4 (set optim.lr)
FULL_FINETUNE_LR = 5e-6  # Megatron-Bridge's full-SFT recipes (torchtune's llama3_2/1B_full: 2e-5)
LORA_LR = 1e-4  # Megatron-Bridge's LoRA / DoRA recipes (torchtune's llama3_2/1B_lora: 3e-4)
MIN_LR_FRACTION = 0.1  # min_lr = lr / 10 when not given: the default run's 3e-3 -> 3e-4, Chinchilla's cosine end

_DEFAULTS = {"pretraining": PRETRAIN_LR, "full fine-tune": FULL_FINETUNE_LR, "LoRA": LORA_LR}


def run_kind(cfg: Config) -> str:
    """`LoRA` (peft.method set), `full fine-tune` (checkpoint.finetune: a checkpoint's weights, fresh optimizer)
    or `pretraining` (everything else, resumes included: a resumed run is the kind it was started as)."""
    if str(cfg.peft.method) != "none":
        return "LoRA"
    return "full fine-tune" if cfg.checkpoint.finetune else "pretraining"


def peak_lr(cfg: Config) -> float:
    """optim.lr, else the run kind's default."""
    return cfg.optim.lr if cfg.optim.lr is not None else _DEFAULTS[run_kind(cfg)]


def min_lr(cfg: Config) -> float:
    """optim.min_lr, else a tenth of the peak."""
    if cfg.optim.min_lr is not None:
        return cfg.optim.min_lr
    return float(f"{peak_lr(cfg) * MIN_LR_FRACTION:.12g}")  # 3e-3 -> 3e-4, not 3.0000000000000003e-4


def describe(cfg: Config) -> str:
    """`lr 1e-04 -> 1e-05 (the LoRA default, min lr/10)` for the config line: the values and where they came from."""
    o = cfg.optim
    source = f"the {run_kind(cfg)} default" if o.lr is None else "optim.lr"
    end = "optim.min_lr" if o.min_lr is not None else "lr/10"
    return f"lr {peak_lr(cfg):.0e} -> {min_lr(cfg):.0e} ({source}, min {end})"
