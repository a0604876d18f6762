"""The typed config schema. Hydra composes conf/*.yaml onto these dataclasses; every field has a default
and a one-line reason, and the defaults are the default run's (conf/config.yaml's groups: a test composes
both and compares). A field with a fixed set of choices is an Enum: OmegaConf refuses any other value
while composing (training/config/compose.py makes that one line). Cross-field rules live in training/config/validate.py
and run before any process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Optional

from training.config.schema_model import (  # noqa: F401 (re-exported: model.*)
    Activation, Dispatcher, ModelConfig, MoEConfig, Normalization, NormPlacement, PositionEmbedding, QkNormSpan,
    Recompute, ScoreFunction)
from training.config.schema_post import Objective, PostConfig, Reference  # noqa: F401 (post.*)
from training.config.schema_rope import RopeScalingConfig, RopeScalingType  # noqa: F401 (model.rope_scaling)


class DecayStyle(StrEnum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class DataFormat(StrEnum):
    text = "text"  # documents: every token a target, packed end to end across documents (pretraining)
    sft = "sft"  # conversations (tools/preprocess_data.py --format sft): answers only, packed apart
    preference = "preference"  # pairs (--format preference): a prompt, a chosen and a rejected answer (post=dpo)


PACKED = ("sft", "preference")  # data formats packed per sequence (segments apart): every pipeline stage reads them


class Overlong(StrEnum):
    truncate = "truncate"  # keep the first seq_length + 1 tokens (a later answer loses its end)
    drop = "drop"  # leave the conversation out


class Precision(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"  # bf16 params/activations, fp32 main params and grads


class Fsdp(StrEnum):
    none = "none"  # DDP (+ the distributed optimizer with parallel.dist_opt: ZeRO-1)
    optim_grads = "optim_grads"  # ZeRO-2: Megatron-FSDP shards gradients and optimizer state over DP
    optim_grads_params = "optim_grads_params"  # ZeRO-3: also the parameters, gathered per layer when used


class TpBlock(StrEnum):
    attention = "attention"  # the attention block (its QKV and output projections, heads split)
    mlp = "mlp"  # the dense MLP (its FFN width split): the largest block of a dense layer
    vocab = "vocab"  # the embedding table and the output layer (vocabulary rows split)


class OnSaveError(StrEnum):
    stop = "stop"  # a failed save ends the run (with an error naming it); the last checkpoint stays latest
    warn = "warn"  # say so and train on; the next save tries again


class NanPolicy(StrEnum):
    stop = "stop"
    skip = "skip"


class PeftMethod(StrEnum):
    none = "none"  # every parameter trains (pretraining, full fine-tuning)
    lora = "lora"  # low-rank adapters on the target linears; every other weight frozen (docs/peft.md)


class WandbMode(StrEnum):
    disabled = "disabled"  # no W&B: nothing imported, nothing sent
    online = "online"  # stream to the W&B server (`wandb login` or WANDB_API_KEY first)
    offline = "offline"  # write the run's files locally only; `wandb sync <dir>` uploads them later


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor parallel size: splits heads and MLP width; keep within one node (NVLink)
    pp: int = 1  # pipeline parallel size: splits layers into stages
    vpp: Optional[int] = None  # virtual stages per pipeline rank (interleaved 1F1B); null = plain 1F1B
    sp: bool = False  # sequence parallel: shard norms/dropout activations along the sequence (needs tp>1)
    cp: int = 1  # context parallel size: each rank holds 1/cp of every sequence (long contexts; K/V all-gathered)
    ep: int = 1  # expert parallel size: MoE experts split over ranks of the data-parallel group (all-to-all)
    etp: int = 1  # expert tensor parallel size: each expert's FFN split over this many ranks
    tp_blocks: list[TpBlock] = field(default_factory=lambda: list(TpBlock))  # what tp splits; the rest is whole
    # on every TP rank, with no TP communication ([mlp]: only the largest block, docs/parallelism.md); all: Megatron's
    dist_opt: bool = False  # distributed optimizer: shard fp32 main params + Adam state across DP ranks
    fsdp: Fsdp = Fsdp.none  # Megatron-FSDP: optim_grads (ZeRO-2) | optim_grads_params (ZeRO-3); sets dist_opt
    overlap_grad_reduce: bool = False  # overlap DP gradient reduction with backward (bucketed)
    overlap_param_gather: bool = False  # overlap the distributed optimizer's param all-gather with forward
    bucket_size: Optional[int] = None  # DDP bucket size in elements; null = Megatron-Core's default
    timeout_minutes: float = 10.0  # collective timeout: a hang fails after this instead of 30 minutes


@dataclass
class OptimConfig:
    lr: Optional[float] = None  # peak lr after warmup; null = by run kind: 3e-3 scratch, 5e-6 fine-tune, 1e-4 LoRA
    min_lr: Optional[float] = None  # lr at the end of decay; null = lr / 10 (training/config/optim_defaults.py)
    warmup_iters: int = 20  # linear warmup from 0 to lr
    decay_style: DecayStyle = DecayStyle.cosine  # cosine | linear | constant
    decay_iters: Optional[int] = None  # iteration where decay reaches min_lr; null = train.iters
    weight_decay: float = 0.1  # AdamW decoupled weight decay (not applied to norms and biases)
    adam_beta1: float = 0.9  # Adam first-moment decay
    adam_beta2: float = 0.95  # Adam second-moment decay (0.95 is the LLM norm, more stable than 0.999)
    adam_eps: float = 1e-8  # Adam epsilon
    clip_grad: float = 1.0  # global gradient-norm clipping; 0 disables


@dataclass
class DataConfig:
    paths: list[str] = field(default_factory=list)  # indexed-dataset prefixes (.bin/.idx); [] = embedded text
    weights: Optional[list[float]] = None  # blend weights, one per path; null = proportional to size
    split: str = "95,5,0"  # train,valid,test shares of each dataset's documents (test is unused)
    tokenizer: str = "byte"  # byte (built in, no download) or a path to a Hugging Face tokenizer.json
    cache_dir: Optional[str] = None  # where index caches and the embedded corpus go; null = <repo>/.cache
    mock: bool = False  # random tokens (Megatron-Core's MockGPTDataset): for benchmarks only
    eod_mask_loss: bool = False  # exclude the end-of-document token from the loss
    format: DataFormat = DataFormat.text  # text | sft: what data.paths hold (docs/sft.md)
    overlong: Overlong = Overlong.truncate  # sft: a conversation longer than the sequence (counted in the log)


@dataclass
class WandbConfig:
    mode: WandbMode = WandbMode.disabled  # off by default: W&B is an optional extra (pip install -e '.[wandb]')
    project: str = "mcore-template"  # the W&B project runs go to
    name: Optional[str] = None  # the run's display name; null = W&B's generated one
    entity: Optional[str] = None  # the W&B user or team; null = your default entity
    dir: Optional[str] = None  # where W&B writes its local files (<dir>/wandb/); null = $WANDB_DIR, else the run dir


@dataclass
class TrainConfig:
    iters: int = 200  # optimizer steps in the run (0: build, save the initial checkpoint, exit)
    micro_batch_size: int = 4  # sequences per micro-batch per data-parallel rank
    global_batch_size: int = 16  # sequences per optimizer step, all DP ranks and micro-batches together
    seed: int = 1234  # one seed for init, dropout and data order
    precision: Precision = Precision.fp32  # fp32 | bf16 (bf16 params/activations, fp32 main params and grads)
    log_interval: int = 10  # iterations between log lines
    eval_interval: int = 100  # iterations between validation runs; 0 disables
    eval_iters: int = 2  # validation global batches per evaluation
    save_interval: int = 0  # iterations between checkpoints; 0 = only at the end (when checkpoint.dir)
    save_interval_minutes: float = 0.0  # also save once this much wall-clock time passed since the last; 0 = off
    exit_interval: int = 0  # stop (after saving) at an iteration multiple of this; 0 = never
    exit_duration_minutes: float = 0.0  # stop (after saving) after this wall-clock time; 0 = never
    nan_policy: NanPolicy = NanPolicy.stop  # stop | skip: what a NaN/Inf loss or gradient does (before the update)
    watchdog_factor: float = 10.0  # a step this many times the recent median is a hang (engine/watchdog.py); 0 = off
    watchdog_min_seconds: float = 300.0  # ... but a step may always take this long (compiles, saves, slow disks)
    profile: bool = False  # torch.profiler trace of iterations [profile_start, profile_end)
    profile_start: int = 5  # first profiled iteration (after warm-up)
    profile_end: int = 7  # first iteration after the profiled window
    tensorboard: bool = True  # write TensorBoard scalars into <run dir>/tensorboard
    wandb: WandbConfig = field(default_factory=WandbConfig)  # Weights & Biases: the metrics.jsonl records, rank 0
    max_memory_fraction: float = 0.9  # preflight: stop above this share of GPU memory (CUDA context, NCCL
    # buffers and fragmentation take the rest)


@dataclass
class CheckpointConfig:
    dir: Optional[str] = "checkpoints"  # where iter_XXXXXXX/ checkpoints go (relative: in the run dir); null = none
    load: Optional[str] = "auto"  # auto (resume from dir's latest if any) | null (fresh) | a path
    keep: int = 3  # newest checkpoints kept; older ones are deleted after a successful save; 0 = all
    finetune: bool = False  # start from checkpoint.load's weights only: fresh optimizer, schedule, data, iteration 0
    on_save_error: OnSaveError = OnSaveError.stop  # stop | warn: a save that fails (disk full) never becomes latest
    async_save: bool = False  # write checkpoints in a background process while training goes on (not FSDP)


@dataclass
class PeftConfig:
    method: PeftMethod = PeftMethod.none  # none | lora (conf/peft/lora.yaml: peft=lora)
    rank: int = 8  # LoRA rank r: A is [r, in], B [out, r] (HF PEFT's default r)
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank (HF PEFT's lora_alpha; 2r is common)
    dropout: float = 0.0  # dropout on the adapter's input (HF PEFT's lora_dropout); 0: deterministic adapters
    targets: list[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    # ^ the linears that get an adapter, by module name (a custom block's own names too): all of a layer's;
    # canonical LoRA (models/lora_split.py: an A and a B per part, PEFT's layout): linear_q, linear_k, linear_v
    # in place of linear_qkv, linear_fc1_gate, linear_fc1_up in place of linear_fc1
    trainable: list[str] = field(default_factory=list)  # other parameters that train, as fnmatch patterns on
    # parameter names (e.g. '*layernorm*'); []: only the adapters


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    post: PostConfig = field(default_factory=PostConfig)


def register() -> None:
    """Register the schema with Hydra's ConfigStore as `schema` (conf/config.yaml lists it first)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="schema", node=Config)


def to_config(cfg: Any) -> Config:
    """A composed OmegaConf (or a plain dict) -> the typed dataclass tree."""
    from omegaconf import OmegaConf

    if isinstance(cfg, Config):
        return cfg
    merged = OmegaConf.merge(OmegaConf.structured(Config), cfg)
    config = OmegaConf.to_object(merged)
    if config.parallel.fsdp != Fsdp.none:  # Megatron-FSDP shards through the distributed optimizer
        config.parallel.dist_opt = True
    return config


__all__ = ["Activation", "DecayStyle", "Dispatcher", "Fsdp", "MoEConfig", "NanPolicy", "OnSaveError", "ScoreFunction",
           "RopeScalingConfig", "RopeScalingType",
           "Normalization", "NormPlacement", "PositionEmbedding", "Precision", "QkNormSpan",
           "Recompute", "TpBlock",
           "Config", "ModelConfig", "ParallelConfig", "OptimConfig", "DataConfig", "TrainConfig",
           "CheckpointConfig", "Objective", "PostConfig", "Reference", "WandbConfig", "WandbMode", "register", "to_config"]
