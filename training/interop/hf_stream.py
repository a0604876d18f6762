"""Streamed Hugging Face import: the template checkpoint written tensor by tensor, never the whole model in memory.

The model is built on the meta device (shapes, no storage); its sharded state dict goes through Megatron-Core's
own dist_checkpointing.save (the same keys, metadata.json, common state and integrity manifest as a training
save) with one change, the strategy that writes the shards (`StreamingSave`): torch DCP's FileSystemWriter with
one thread writes the items in the state dict's order, and each item's data is made only when DCP asks for it
(`LazyPlanner.resolve_data`): the HF walk (models/gpt.py from_hf: one block's tensors at a time, read from the
safetensors lazily) is advanced to that parameter, the tensor written, then dropped once its last item (SwiGLU's
fc1 is two) is written. Resident memory: one block's tensors, read (pread, not mapped) and converted.

`plan` first runs the same walk on meta tensors made from the safetensors headers: every name, shape and
unread tensor is checked before a byte is written (an error is one line, not a failure inside DCP's writer).
"""

from __future__ import annotations

import queue

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)

from models import gpt as gpt_module
from training.interop.hf_config import HFError
from training.parallel.wrap import unwrap


FILE_BYTES = 1 << 30  # the checkpoint's files: at most 1 GiB each (what the writer holds in memory at once)


class ParamSource:
    """Our full parameters (name -> tensor) from the HF walk, made in the walk's order when first asked for and
    dropped after `uses[name]` requests: the walk runs once, block by block."""

    def __init__(self, walk, uses: dict[str, int]):
        self.walk, self.uses, self.ready, self.done = iter(walk), dict(uses), {}, set()
        self.bytes = 0  # parameters' bytes handed out (the progress line)

    def take(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        while name not in self.ready:
            if name in self.done:
                raise HFError(f"{name} was asked for twice after its last use (write order changed?)")
            try:
                ours, tensor = next(self.walk)
            except StopIteration:
                raise HFError(f"the Hugging Face walk never made {name}") from None
            self.ready[ours] = tensor
        tensor = self.ready[name].to(dtype)  # the checkpoint's dtype (no copy when it is already)
        self.uses[name] -= 1
        if not self.uses[name]:
            del self.ready[name]
            self.done.add(name)
            self.bytes += tensor.nbytes
        return tensor


class LazyPlanner(MCoreSavePlanner):
    """Megatron-Core's save planner for a meta-device model: resolve_data makes each item's real tensor, the
    same view of the full parameter (from `source`) as the item's ShardedTensor was of the meta parameter."""

    def __init__(self, names: dict[int, str], source_of, progress=None):
        super().__init__(dedup_replicated_tensors=False, flatten_state_dict=False, flatten_sharded_tensors=False)
        self.names, self.source_of, self.progress = names, source_of, progress
        self.views: dict[tuple, tuple] = {}  # (key, global offset) -> (parameter, size, stride, storage offset)
        self.source = None

    def record(self, flat: dict) -> None:
        """Before Megatron-Core's conversion detaches them: which parameter (and view of it) each ShardedTensor
        of the flat sharded state dict holds."""
        for shards in flat.values():
            for sh in shards:
                data = getattr(sh, "data", None)
                if not isinstance(data, torch.Tensor) or not data.is_meta:
                    continue
                base = data if data._base is None else data._base
                if id(base) not in self.names:
                    raise HFError(f"checkpoint tensor {sh.key} is no view of a model parameter")
                self.views[sh.key, tuple(sh.global_offset)] = (
                    self.names[id(base)], data.size(), data.stride(), data.storage_offset())

    def _view(self, item) -> tuple | None:
        return self.views.get((item.index.fqn, tuple(item.index.offset or ()))) if item.index.offset else None

    def create_local_plan(self):
        plan = super().create_local_plan()
        uses: dict[str, int] = {}
        for item in plan.items:
            if view := self._view(item):
                uses[view[0]] = uses.get(view[0], 0) + 1
        self.source = self.source_of(uses)
        return plan

    def resolve_data(self, write_item):
        obj = self.lookup_object(write_item.index)
        if isinstance(obj, torch.Tensor) and obj.is_meta:
            name, size, stride, offset = self._view(write_item)
            full = self.source.take(name, obj.dtype).contiguous()  # [the whole parameter], e.g. [2 * ffn, h]
            # this item's view of it; `full` may itself be a view into a larger tensor (gpt-oss's down_proj_bias[j]):
            # the item's offset counts from full's own first element
            obj = full.as_strided(size, stride, full.storage_offset() + offset).reshape(obj.shape)
            if self.progress is not None:
                self.progress(self.source.bytes)
        return self.transform_object(write_item, obj)


class BucketedWriter(dcp.FileSystemWriter):
    """DCP's FileSystemWriter writing the items in plan order into files of at most `file_bytes` (an item larger
    alone): torch 2.14's writer keeps every tensor of a file until the file is done (its safetensors format
    needs them), so a file's size is what it holds in memory. (Its own choices: one file per rank, the whole
    model held; or one file per tensor, ~50,000 files for a large MoE.)"""

    def __init__(self, path: str, file_bytes: int):
        super().__init__(path, thread_count=1, single_file_per_rank=True)
        self.file_bytes = file_bytes

    def write_data(self, plan, planner):
        buckets, size = [[]], 0
        for item in plan.items:
            nbytes = item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize \
                if item.tensor_data is not None else 0
            if buckets[-1] and size + nbytes > self.file_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(item)
            size += nbytes
        files: queue.Queue = queue.Queue()
        for i, bucket in enumerate(buckets):
            name = f"{plan.storage_data.prefix}{i}{DEFAULT_SUFFIX}"
            files.put((self.fs.concat_path(self.path, name), name, bucket))
        return self._write_data(planner, files)


class StreamingSave(TorchDistSaveShardedStrategy):
    """Megatron-Core's torch_dist format written synchronously by DCP in the state dict's order into files of
    at most file_bytes (BucketedWriter), the data made per item by `planner` (LazyPlanner)."""

    def __init__(self, planner: LazyPlanner, file_bytes: int):
        super().__init__()
        self.planner, self.file_bytes = planner, file_bytes

    def save(self, sharded_state_dict, checkpoint_dir):
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        self.planner.record(flat)
        writer = BucketedWriter(str(checkpoint_dir), self.file_bytes)
        dcp.save(mcore_to_pyt_state_dict(flat, False), storage_writer=writer, planner=self.planner)
        if self.planner.progress is not None:
            self.planner.progress.close()  # the shards are written (the metadata and manifest follow)


def meta_getter(weights):
    """get(name) of HF tensors as meta tensors of their shape and dtype (from the safetensors headers)."""
    def get(name: str) -> torch.Tensor:
        shape, dtype = weights.header(name)
        return torch.empty(shape, dtype=dtype, device="meta")
    get.family = weights.family
    return get


def walk(state, get):
    """models/gpt.py's from_hf walk for this model (tp=1, pp=1), HF's ValueErrors as HFError."""
    from training.interop.hf import _hf_errors, _with_family

    gpt = unwrap(state.model[0])
    return _hf_errors(gpt_module.from_hf, get, _with_family(gpt.config, getattr(get, "family", None)), state.shape)


def plan(state, weights, tied: bool) -> int:
    """The walk on meta tensors: every parameter made exactly once with its shape, every HF tensor read (else
    one HFError naming them); returns the parameter count. Reads no tensor data."""
    from training.interop.hf import weights_of

    params = weights_of(unwrap(state.model[0]))
    count = 0
    for name, tensor in walk(state, meta_getter(weights)):
        param = params.pop(name, None)
        if param is None or param.shape != tensor.shape:
            raise HFError(f"{name}: converted shape {tuple(tensor.shape)} does not fit the model's "
                          f"{None if param is None else tuple(param.shape)}")
        count += tensor.numel()
    if params:
        raise HFError(f"parameters the Hugging Face mapping does not fill: {sorted(params)}")
    if unread := weights.unread(tied=tied):
        raise HFError(f"tensors our GPT has no place for (another architecture?): {unread[:8]}")
    weights.read.clear()
    return count


def streaming_save(state, weights, progress=None) -> StreamingSave:
    """The strategy for checkpoint.save(..., strategy=) that writes this meta-device model's checkpoint from
    `weights` (hf.HFWeights) tensor by tensor, in files no larger than its largest shard (at most FILE_BYTES)."""
    from training.interop.hf import weights_of

    names = {id(p): n for n, p in weights_of(unwrap(state.model[0])).items()}
    planner = LazyPlanner(names, lambda uses: ParamSource(walk(state, weights), uses), progress)
    return StreamingSave(planner, min(FILE_BYTES, weights.largest_shard()))


def param_bytes(state) -> int:
    """The bytes of this (meta-device) model's parameters in their dtype: what the import writes."""
    return sum(p.numel() * p.element_size() for p in unwrap(state.model[0]).parameters())
