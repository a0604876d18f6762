"""The names people bring from Megatron-LM's arguments, torchtitan's TOML and Hugging Face's TrainingArguments,
mapped to ours, for the unknown-key error (training/config/compose.py): `tensor_model_parallel_size=2` is answered
`unknown key 'tensor_model_parallel_size' (Megatron-LM's name; here: parallel.tp)`, not with the nearest spelling.

Keys are the last part of the name, lowercase, `-` as `_` (so `--tensor-model-parallel-size`,
`parallelism.tensor_parallel_degree` and `training.steps` all match).
"""

from __future__ import annotations

import difflib

DP = "nothing: DP is the world size / (tp * pp * cp), never set (docs/config.md)"

# name -> (ours, whose name it is)
ALIASES: dict[str, tuple[str, str]] = {
    # Megatron-LM (megatron/training/arguments.py)
    "tensor_model_parallel_size": ("parallel.tp", "Megatron-LM"),
    "pipeline_model_parallel_size": ("parallel.pp", "Megatron-LM"),
    "virtual_pipeline_model_parallel_size": ("parallel.vpp", "Megatron-LM"),
    "num_layers_per_virtual_pipeline_stage": ("parallel.vpp (chunks per stage, not layers)", "Megatron-LM"),
    "context_parallel_size": ("parallel.cp", "Megatron-LM"),
    "expert_model_parallel_size": ("parallel.ep", "Megatron-LM"),
    "expert_tensor_parallel_size": ("parallel.etp", "Megatron-LM"),
    "sequence_parallel": ("parallel.sp", "Megatron-LM"),
    "use_distributed_optimizer": ("parallel.dist_opt", "Megatron-LM"),
    "data_parallel_size": (DP, "Megatron-LM"),
    "train_iters": ("train.iters", "Megatron-LM"),
    "lr_warmup_iters": ("optim.warmup_iters", "Megatron-LM"),
    "lr_decay_iters": ("optim.decay_iters", "Megatron-LM"),
    "lr_decay_style": ("optim.decay_style", "Megatron-LM"),
    "recompute_granularity": ("model.recompute", "Megatron-LM"),
    "bf16": ("train.precision=bf16", "Megatron-LM / HF"),
    "save": ("checkpoint.dir", "Megatron-LM"),
    "load": ("checkpoint.load", "Megatron-LM"),
    "finetune": ("checkpoint.finetune", "Megatron-LM"),
    "data_path": ("data.paths", "Megatron-LM"),
    "tokenizer_model": ("data.tokenizer", "Megatron-LM"),
    "max_position_embeddings": ("model.max_position_embeddings", "Megatron-LM"),
    # torchtitan (torchtitan/config/job_config.py)
    "tensor_parallel_degree": ("parallel.tp", "torchtitan"),
    "pipeline_parallel_degree": ("parallel.pp", "torchtitan"),
    "context_parallel_degree": ("parallel.cp", "torchtitan"),
    "expert_parallel_degree": ("parallel.ep", "torchtitan"),
    "expert_tensor_parallel_degree": ("parallel.etp", "torchtitan"),
    "data_parallel_shard_degree": ("parallel.fsdp (ZeRO-3 over all of DP; " + DP + ")", "torchtitan"),
    "data_parallel_replicate_degree": (DP, "torchtitan"),
    "enable_async_tensor_parallel": ("parallel.tp (no async TP here)", "torchtitan"),
    "steps": ("train.iters", "torchtitan"),
    "local_batch_size": ("train.micro_batch_size", "torchtitan"),
    "seq_len": ("model.seq_length", "torchtitan"),
    "warmup_steps": ("optim.warmup_iters", "torchtitan / HF"),
    "mixed_precision_param": ("train.precision", "torchtitan"),
    # Hugging Face TrainingArguments
    "learning_rate": ("optim.lr", "HF"),
    "per_device_train_batch_size": ("train.micro_batch_size", "HF"),
    "gradient_accumulation_steps": ("train.global_batch_size (= micro x dp x accumulation)", "HF"),
    "max_steps": ("train.iters", "HF"),
    "lr_scheduler_type": ("optim.decay_style", "HF"),
    "max_grad_norm": ("optim.clip_grad", "HF"),
    "save_steps": ("train.save_interval", "HF"),
    "eval_steps": ("train.eval_interval", "HF"),
    "logging_steps": ("train.log_interval", "HF"),
    "gradient_checkpointing": ("model.recompute=full", "HF"),
    "output_dir": ("RUN_DIR=... launch/train.sh (or hydra.run.dir)", "HF"),
    "adam_epsilon": ("optim.adam_eps", "HF"),
}
# a short spelling of a parallelism (`tensor_parallel`, `pipeline_parallel`): matched by prefix below
PARALLEL_WORDS = {"tensor": "parallel.tp", "pipeline": "parallel.pp", "context": "parallel.cp",
                  "expert": "parallel.ep", "sequence": "parallel.sp", "data": DP}


def _name(key: str) -> str:
    return key.lstrip("-+~").rsplit(".", 1)[-1].lower().replace("-", "_")


def exact(key: str) -> str | None:
    """`Megatron-LM's name; here: parallel.tp` for another framework's exact name, or None."""
    if (name := _name(key)) in ALIASES:
        ours, whose = ALIASES[name]
        return f"{whose}'s name; here: {ours}"
    return None


def alias(key: str) -> str | None:
    """`did you mean parallel.tp?` for a short `tensor_parallel`; `like Megatron-LM's ...; here: ...` for a near
    spelling of another framework's name; or None."""
    name = _name(key)
    words = name.split("_")
    if len(words) >= 2 and words[1] in ("parallel", "parallelism", "model") and words[0] in PARALLEL_WORDS:
        return f"did you mean {PARALLEL_WORDS[words[0]]}?"
    near = difflib.get_close_matches(name, list(ALIASES), n=1, cutoff=0.85)
    if near:
        ours, whose = ALIASES[near[0]]
        return f"like {whose}'s {near[0]}; here: {ours}"
    return None
