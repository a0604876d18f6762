"""post.*: what a post-training run optimises instead of the next-token loss (training/post/, docs/preference.md).

    launch/train.sh data.format=preference data.paths=[data/pairs] post=dpo checkpoint.load=... checkpoint.finetune=true

`post.objective=none` is pretraining and SFT (the token loss); the preference objectives take pairs (a prompt, a
better and a worse answer: data.format=preference) and are functions of each answer's summed log-probability.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Optional

from training.config.schema_rl import RLConfig


class Objective(StrEnum):
    none = "none"  # the token loss (pretraining, SFT)
    sigmoid = "sigmoid"  # DPO: -log sigmoid(beta * (chosen log-ratio - rejected log-ratio)) (TRL's default)
    ipo = "ipo"  # IPO: (the length-normalised log-ratio difference - 1 / (2 beta))^2 (TRL's normalisation)
    hinge = "hinge"  # SLiC: relu(1 - beta * the log-ratio difference)
    robust = "robust"  # robust DPO: sigmoid with the labels flipped at rate post.label_smoothing, unbiased
    simpo = "simpo"  # SimPO: reference-free, length-normalised log-probs, margin post.simpo_gamma (TRL's CPO)
    grpo = "grpo"  # RL from rewards: the policy's own rollouts, group advantages, a clipped surrogate (post.rl)


class Reference(StrEnum):
    live = "live"  # a frozen copy of post.reference_load's weights beside the policy, scored every step
    stored = "stored"  # that model's log-probs of every pair, scored once and kept beside the data: one model
    lora_base = "lora_base"  # peft=lora: the policy with its adapters off (no second model)
    none = "none"  # reference-free objectives (simpo)


@dataclass
class PostConfig:
    objective: Objective = Objective.none  # none: the token loss; a preference objective needs data.format=preference
    beta: float = 0.1  # the KL strength (DPO's beta; IPO's tau; SimPO's beta is 2.0 in its paper): TRL's default
    label_smoothing: float = 0.0  # robust: the rate preferences are flipped, in [0, 0.5); simpo: its smoothing
    simpo_gamma: float = 0.5  # simpo: the target reward margin gamma (TRL's CPOConfig default)
    sft_weight: float = 0.0  # + weight * the chosen answers' token-mean NLL (RPO; TRL's loss_type=[..., "sft"])
    reference: Reference = Reference.stored  # where the reference log-probs come from: scored once, one model (simpo: none)
    reference_load: Optional[str] = None  # live, stored: the reference checkpoint (null: checkpoint.load, the SFT model)
    reference_logps: Optional[str] = None  # stored: the scores' file (null: PREFIX.ref-<digest>.npz beside the data)
    rl: RLConfig = field(default_factory=RLConfig)  # post.objective=grpo's rollouts, rewards and loss
