"""Layout-independent initialisation: every weight's initial value is a function of the seed and the weight's
name and position in the full model, so the same seed gives the same model at any TP / SP / PP / VPP / CP /
EP / FSDP layout (and the founding note's check "same seed, one GPU or many, same losses" holds).

    with recording(config) as recorded:      # around building this rank's model chunks
        chunks = [make_model(...) ...]
    initialize(chunks, recorded, seed)       # then, before bf16 casting and DDP / FSDP wrapping

Megatron-Core draws a TP-sharded weight either as the full tensor on the CPU in construction order (CPU init)
or as this rank's shard from its rank's RNG stream (GPU init); both depend on the layout: the padded vocabulary
(a multiple of 128 x tp), a pipeline stage's seed, which experts a rank builds. Here, while the model is built,
Megatron-Core's two initialisers (`_initialize_affine_weight_cpu` / `_gpu`) and the config's init methods only
record which init method each parameter takes. Then each parameter is drawn by name from the model's sharded
state dict (the checkpoint keys: global layer numbers, global expert indices, SwiGLU's gate and up as their own
tensors): the global tensor in blocks of ROWS rows, block j from a generator seeded by (seed, name, j), only the
blocks that overlap this rank's slice. Padding rows of the vocabulary are blocks of their own, so they shift
nothing. Norm weights (ones) and biases (zeros) are constants and keep Megatron-Core's init.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from megatron.core.tensor_parallel import layers

ROWS = 64  # rows per generated block of a global tensor (the padding rows of a vocabulary: blocks of their own)


@contextlib.contextmanager
def recording(config):
    """Within: weights are not drawn; `recorded` maps each parameter to its init method."""
    recorded: dict[torch.nn.Parameter, object] = {}
    cpu, gpu = layers._initialize_affine_weight_cpu, layers._initialize_affine_weight_gpu
    methods = {name: getattr(config, name) for name in ("init_method", "output_layer_init_method",
                                                        "embedding_init_method") if getattr(config, name, None)}

    def record_cpu(weight, output_size, input_size, per_partition_size, partition_dim, init_method, stride=1,
                   return_master_weight=False, *, skip_set_tensor_parallel_attributes=False, **_):
        if not skip_set_tensor_parallel_attributes:
            layers.set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
        recorded[weight] = init_method

    def record_gpu(weight, init_method, partition_dim, stride=1, is_expert=False):
        layers.set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
        recorded[weight] = init_method

    def recorder(method):
        def init(tensor):  # a direct call on a parameter (a router, learned positions) is recorded
            if isinstance(tensor, torch.nn.Parameter):
                recorded[tensor] = method
            else:
                method(tensor)
        return init

    layers._initialize_affine_weight_cpu, layers._initialize_affine_weight_gpu = record_cpu, record_gpu
    for name, method in methods.items():
        setattr(config, name, recorder(method))
    try:
        yield recorded
    finally:
        layers._initialize_affine_weight_cpu, layers._initialize_affine_weight_gpu = cpu, gpu
        for name, method in methods.items():
            setattr(config, name, method)


def _seed(seed: int, key: str, *index: int) -> int:
    digest = hashlib.sha256(f"{seed}/{key}/{'/'.join(map(str, index))}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _draw(init_method, key: str, seed: int, prefix: tuple, global_shape: tuple, offset: tuple,
          local_shape: tuple, device: torch.device) -> torch.Tensor:
    """This rank's slice [offset, offset + local_shape) of the global tensor `key` (one index `prefix` of its
    prepended axes, e.g. one expert), drawn in row blocks; float32."""
    first, last = offset[0], offset[0] + local_shape[0]
    blocks = []
    for j in range(first // ROWS, (last - 1) // ROWS + 1):  # whole blocks: a block's values never depend on
        block = torch.empty((ROWS, *global_shape[1:]), dtype=torch.float32, device=device)  # the row count
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(_seed(seed, key, *prefix, j))  # seeds the CPU and the CUDA generators
            init_method(block)
        blocks.append(block)
    full_rows = torch.cat(blocks)[first % ROWS:][: local_shape[0]]  # [local rows, ...]
    index = tuple(slice(o, o + n) for o, n in zip(offset[1:], local_shape[1:]))
    return full_rows[(slice(None), *index)]


def _sharded_tensors(chunk) -> list[ShardedTensor]:
    state = chunk.sharded_state_dict()
    apply_factories(state)  # SwiGLU's fc1 -> its gate and up halves, views of the one weight
    out, todo = [], [state]
    while todo:
        value = todo.pop()
        if isinstance(value, dict):
            todo.extend(value.values())
        elif isinstance(value, (list, tuple)):
            todo.extend(value)
        elif isinstance(value, ShardedTensor) and value.data is not None:
            out.append(value)
    return out


@torch.no_grad()
def initialize(chunks: list, recorded: dict, seed: int) -> None:
    """Draw every recorded parameter of these (bare) chunks by its name; refuse a random weight that no
    init method of the config initialised (it would differ between layouts)."""
    by_storage = {p.untyped_storage().data_ptr(): p for p in recorded}
    done = set()
    for chunk in chunks:
        for st in _sharded_tensors(chunk):
            param = by_storage.get(st.data.untyped_storage().data_ptr())
            if param is None:
                continue
            n = st.prepend_axis_num
            value = _draw(recorded[param], st.key, seed, tuple(st.global_offset[:n]), tuple(st.global_shape[n:]),
                          tuple(st.global_offset[n:]), tuple(st.data.shape), st.data.device)
            st.data.copy_(value)
            done.add(param)
    missing = [name for chunk in chunks for name, p in chunk.named_parameters() if p in recorded and p not in done]
    unrecorded = [name for chunk in chunks for name, p in chunk.named_parameters() if p.dim() > 1 and p not in recorded]
    if missing or unrecorded:
        raise RuntimeError(f"initialisation: parameters without a checkpoint key {missing[:4]}, or initialised "
                           f"outside the config's init methods {unrecorded[:4]}: a block's weights take "
                           f"config.init_method / output_layer_init_method (models/spec.py), so that every "
                           f"layout draws the same values")
