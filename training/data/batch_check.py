"""The token ids of each global batch checked against the model's vocabulary before its schedule runs
(training/engine/step.py run_schedule): a dataset damaged after preprocessing (its .bin changed, its .json
intact, so training/data/datasets.py check_prefix passed it) stops the run with one line naming the file and the
sample, before any forward, backward or optimizer step, instead of an IndexError deep inside the embedding.

    check_token_ids(streams, num_microbatches, vocab_size, device)   # raises DamagedData

Each rank reads its micro-batches of the step ahead (MicroBatches.read_ahead: the same reads, earlier) and
takes a min and a max of each; one all-reduce of the first bad sample's index then makes every rank raise the
same error at the same point: rank 0 prints it (training/errors.py) whichever rank read the sample, and no rank
is left waiting in a collective for one that stopped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from training.data.streams import MicroBatches
from training.errors import TemplateError

NONE = 2**62  # no bad sample


class DamagedData(TemplateError):
    pass


def check_token_ids(streams, count: int, vocab_size: int, device: torch.device) -> None:
    """Raise DamagedData on every rank if any rank's next `count` micro-batches hold an id outside [0, vocab)."""
    readers = [s for s in (streams if isinstance(streams, list) else [streams]) if isinstance(s, MicroBatches)]
    first = NONE
    for reader in readers:
        for start, batch in reader.read_ahead(count):
            if (row := bad_row(batch, vocab_size)) is not None:
                first = min(first, start + row)
    if dist.is_initialized() and dist.get_world_size() > 1:
        found = torch.tensor([first], dtype=torch.int64, device=device)
        dist.all_reduce(found, op=dist.ReduceOp.MIN)
        first = int(found.item())
    if first != NONE:
        raise DamagedData(describe(readers[0].dataset if readers else None, first, vocab_size))


def bad_row(batch: dict[str, torch.Tensor], vocab_size: int) -> int | None:
    """The first row of the micro-batch with a token or label outside [0, vocab_size), or None."""
    for key in ("tokens", "labels"):
        low, high = torch.aminmax(batch[key])
        if low < 0 or high >= vocab_size:
            ids = batch[key]
            return int(((ids < 0) | (ids >= vocab_size)).any(dim=1).nonzero()[0])
    return None


def describe(dataset, index: int, vocab_size: int) -> str:
    """One line: the file, the sample, the id. Megatron-Core's GPT datasets are named by their prefix (a blend's
    by the part the sample comes from); anything else (a list of samples) by the index alone."""
    found, blend = " a token id", ""
    if dataset is not None:
        sample = dataset[index]
        ids = torch.cat([sample["tokens"].flatten(), sample["labels"].flatten()])
        found = f" token id {int(ids[(ids < 0) | (ids >= vocab_size)][0])}"
        if hasattr(dataset, "dataset_index"):  # BlendedDataset: which dataset, which of its samples
            part, blend = int(dataset.dataset_index[index]), f"; sample {index} of the blend"
            dataset, index = dataset.datasets[part], int(dataset.dataset_sample_index[index])
        prefix, split = getattr(dataset, "dataset_path", None), getattr(dataset, "index_split", None)
        if prefix is not None:
            return (f"data: {prefix}.bin holds{found} in its {getattr(split, 'name', '')} sample {index}{blend}, "
                    f"outside the model's vocabulary ({vocab_size} ids): the file was damaged after preprocessing "
                    f"(its .json is intact); re-create it with tools/preprocess_data.py. Stopped before this step's "
                    f"forward: the weights are untouched")
    return (f"data: sample {index} holds{found} outside the model's vocabulary ({vocab_size} ids). Stopped before this "
            f"step's forward: the weights are untouched")
