"""Post-training: what a run optimises after pretraining and SFT, through the same step and loss seam.

    records.py     preference records (the layouts people ship) -> a chosen and a rejected conversation
    pairs.py       pairs on disk -> packed sequences (each pair's two answers side by side, segments apart)
    objectives.py  the preference losses (DPO, IPO, hinge, robust, SimPO) and TRL's metrics, per pair
    logps.py       per-answer log-prob sums from the last stage's token losses, whole across CP
    step.py        the preference step: the reference's pass, then the policy's (training/engine/step.py's seam)
    reference.py   where the reference log-probs come from (a live frozen model, the LoRA base)

Pretraining never imports this package: training/engine/loop.py imports it only when post.objective is set.
"""
