"""Small indexed corpora and data configs for tests/test_data.py and tests/test_data_preprocess.py.

    config(tmp_path, paths, **data)   a Config reading `paths` (short samples, a cache under tmp_path)
    corpus(prefix, count, seed)       writes `count` varied documents with the byte tokenizer; returns them
    decoded(prefix, tokenizer)        every document of an indexed dataset, checked to end in one EOD
"""

import numpy as np
import pytest

from training.config.schema import Config
from training.data.datasets import write_indexed
from training.data.tokenizer import ByteTokenizer

BYTE = ByteTokenizer()

# Expected in the data tests: Megatron-Core guesses rank 0 without torch.distributed, and falls back from TE/Apex.
EXPECTED_WARNINGS = [pytest.mark.filterwarnings("ignore:Could not determine rank:UserWarning"),
                     pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning")]


def config(tmp_path, paths, **data) -> Config:
    cfg = Config()
    cfg.model.seq_length = 16  # short samples: many per small corpus, several documents per sample
    cfg.data.paths, cfg.data.cache_dir = [str(p) for p in paths], str(tmp_path / "cache")
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def corpus(prefix, count=40, seed=0) -> list[str]:
    """`count` distinct documents of varied length (7..121 characters), written with the byte tokenizer."""
    rng = np.random.default_rng(seed)
    docs = [f"doc {i}: " + " ".join(rng.choice(["alpha", "beta", "gamma", "delta"], rng.integers(0, 20)))
            for i in range(count)]
    write_indexed(prefix, (BYTE.encode(d) for d in docs), BYTE)
    return docs


def decoded(prefix, tokenizer=BYTE) -> list[str]:
    """Every document of an indexed dataset, decoded, after checking it ends with exactly one EOD."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    assert len(dataset) == len(dataset.document_indices) - 1  # one sequence per document
    docs = [dataset[i] for i in range(len(dataset))]
    assert all(d[-1] == tokenizer.eod and tokenizer.eod not in d[:-1] for d in docs)
    return [tokenizer.decode(d[:-1]) for d in docs]
