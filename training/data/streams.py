"""This rank's micro-batches: the `data_iterator` Megatron-Core's pipeline schedules take.

    streams = micro_batch_streams(num_chunks, dataset, consumed_samples, micro_batch_size)

`consumed_samples` is the one source of truth for where training is: global batch k holds dataset samples
[k*G, (k+1)*G) whatever the DP size, and DP rank r of D reads, for micro-batch j, the samples
k*G + j*m*D + r*m ... + m (Megatron's pretraining sampler). A resumed run, at any DP size, therefore continues
with exactly the next global batch.
"""

from __future__ import annotations

from collections import deque

import torch

# a sample's fields a micro-batch carries: [s] each (GPTDataset also gives attention_mask / position_ids, unused)
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "segment_ids",
              "answer_ids", "pair_index", "ref_logps",  # preference pairs (training/post/pairs.py)
              "old_logps", "advantages")  # with ref_logps: RL's rollout rows (training/post/rl/step.py)


class MicroBatches:
    """This DP rank's micro-batches, starting at `consumed_samples`, endlessly (one per next()).

    read_ahead(n) reads the next n now (training/data/batch_check.py checks them before the step); next()
    then returns those first, in order."""

    def __init__(self, dataset, consumed_samples: int, micro_batch_size: int, dp_size: int, dp_rank: int):
        self.dataset, self.micro, self.dp, self.rank = dataset, micro_batch_size, dp_size, dp_rank
        self.next_index = consumed_samples  # first sample of the next micro-batch group to read (micro * dp)
        self.ahead: deque[tuple[int, dict]] = deque()  # read, not yet returned: (first sample's index, batch)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return (self.ahead.popleft() if self.ahead else self._read())[1]

    def read_ahead(self, count: int) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """The next `count` micro-batches as (index of its first sample in the dataset, batch)."""
        while len(self.ahead) < count:
            self.ahead.append(self._read())
        return list(self.ahead)[:count]

    def _read(self) -> tuple[int, dict[str, torch.Tensor]]:
        start = self.next_index + self.rank * self.micro
        self.next_index += self.micro * self.dp
        samples = [self.dataset[i] for i in range(start, start + self.micro)]
        return start, {key: torch.stack([s[key] for s in samples]) for key in samples[0] if key in BATCH_KEYS}


def _chunk_reads_data(index: int, num_chunks: int, every_stage: bool = False) -> bool:
    from megatron.core import parallel_state as ps

    vp_stage = index if num_chunks > 1 else None
    return every_stage or ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage) or \
        ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)


def reads_data(num_chunks: int, every_stage: bool = False) -> bool:
    """Whether any of this rank's model chunks takes tokens (first stage) or labels (last stage); every_stage:
    packed sequences, whose segments and positions every stage takes (data.format=sft)."""
    return any(_chunk_reads_data(i, num_chunks, every_stage) for i in range(num_chunks))


def micro_batch_streams(num_chunks: int, samples, consumed_samples: int, micro_batch_size: int,
                        every_stage: bool = False):
    """The `data_iterator` Megatron-Core's schedules take: one MicroBatches stream per model chunk that
    reads data (those on the first or the last pipeline stage, or every one with every_stage), None for the
    others (or when `samples` is None); a bare stream when there is one chunk. `samples` is a dataset or a list
    of samples."""
    from megatron.core import parallel_state as ps

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    streams = [MicroBatches(samples, consumed_samples, micro_batch_size, dp, rank)
               if samples is not None and _chunk_reads_data(i, num_chunks, every_stage) else None
               for i in range(num_chunks)]
    return streams if num_chunks > 1 else streams[0]
