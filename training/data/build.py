"""The run's (train, valid) datasets, by data.format: documents (training/data/datasets.py, Megatron-Core's
GPTDataset) or conversations packed for fine-tuning (training/data/sft.py)."""

from __future__ import annotations

from training.config.schema import Config


def build_datasets(cfg: Config, tokenizer, num_samples: tuple[int, int], needs_data: bool):
    """(train, valid) of at least num_samples' sizes; every rank calls it, ranks with needs_data=False get None."""
    if str(cfg.data.format) == "preference":  # post-training's (training/post/): imported only for its runs
        from training.post import pairs
        return pairs.build(cfg, tokenizer, num_samples, needs_data)
    if str(cfg.data.format) == "sft":
        from training.data import sft
        return sft.build(cfg, tokenizer, num_samples, needs_data)
    from training.data import datasets
    return datasets.build_datasets(cfg, tokenizer, num_samples, needs_data)
