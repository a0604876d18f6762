"""Quiet the warnings and log lines this template triggers on purpose and that ask nothing of the user
(no TE/apex, Megatron-Core's deprecation notes for paths we do not use, INFO chatter while building
dataset indices, torch.distributed.checkpoint's notes on how Megatron-Core calls it). Call first, before
importing megatron.core, in every process (a spawned worker too): what is already printed cannot be taken back.
Our own warnings and upstream errors still show."""

from __future__ import annotations

import logging
import re
import warnings

QUIET_WARNINGS = (
    "Transformer Engine and Apex are not installed",  # used when importable, never required
    "Apex is not installed",
    # launch/ sets CUDA_DEVICE_MAX_CONNECTIONS=1 and preflight says so in a training run on GPUs without it;
    # generation and evaluation run no backward, whose overlap it speeds up
    "When using sequence parallelism it is recommended to set the environment variable",
    "When using async grad allreduce it is recommended to set the environment variable",
    "`torch.distributed.all_gather_into_tensor` is deprecated",  # called inside Megatron-Core
    "`torch.distributed._all_gather_base` is a private function",
    "`torch.distributed._reduce_scatter_base` is a private function",
    "`torch.distributed.reduce_scatter_tensor` is deprecated",  # the distributed optimizer's grad reduce
    "full scope is deprecated",  # TransformerConfig's cuda-graph default, we do not use CUDA graphs
    "MimoModelConfig is experimental",
    "No CUDA runtime is found",
    # Megatron-Core's torch_dist load: each rank reads its own shards (no_dist=True, on purpose), the reader
    # passed positionally, torch ShardedTensors built for DCP: notes to Megatron-Core, nothing to do here
    "torch.distributed is disabled, unavailable or uninitialized",
    "The argument order of load has been changed",
    "Please use DTensor instead and we are deprecating ShardedTensor",
)
QUIET_LOG_PREFIXES = (
    "MCore's async save is deprecated",  # the synchronous save goes through it
    # DDP computes the distributed optimizer's buffer layout itself (its documented fallback) from the same
    # bucket size it uses: precomputing it here would copy DDP's bucketing rules (PP stage, model chunk)
    "DistributedDataParallel: full_param_layout not provided",
    "GPTModel IS DEPRECATED",  # tools/bench.py --compare-mcore builds it as the reference, on purpose
)
# dist_checkpointing compares every rank's common state with rank 0's at save. With the distributed
# optimizer's fully_reshardable format, DP ranks > 0 keep an empty `param_state` in theirs: expected.
EXPECTED_COMMON_STATE_DIFF = "Keys only on rank 0: [], Keys only on {rank}: [('optimizer', 'param_state')], " \
                             "Mismatched keys: []"


class _DropPrefixes(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(QUIET_LOG_PREFIXES)


class _DropExpectedCommonStateDiff(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Rank ") and message.endswith(
            EXPECTED_COMMON_STATE_DIFF.format(rank=message.split()[1])))


_DROP_PREFIXES, _DROP_COMMON_STATE_DIFF = _DropPrefixes(), _DropExpectedCommonStateDiff()  # one each: idempotent


def quiet_known_noise() -> None:
    for prefix in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(prefix))
    # the distributed optimizer's zero_grad asks hasattr(.grad) of its fp32 shards, views of our weights
    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf",
                            module=r"megatron\.core\.optimizer\.")
    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    logging.getLogger("megatron.core.dist_checkpointing.strategies.torch").addFilter(_DROP_PREFIXES)
    logging.getLogger("megatron.core.distributed.distributed_data_parallel").addFilter(_DROP_PREFIXES)
    logging.getLogger("megatron.core.models.gpt.gpt_model").addFilter(_DROP_PREFIXES)
    logging.getLogger("megatron.core.dist_checkpointing.validation").addFilter(_DROP_COMMON_STATE_DIFF)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
