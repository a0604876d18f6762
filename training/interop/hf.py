"""Hugging Face interop, the engine side of tools/convert_hf.py: safetensors in and out (sharded or not, read
lazily), weights into and out of a built GPT, and the whole model's logits at any layout (TP shards and PP
stages gathered) for the logits check. config.json <-> our model config: training/interop/hf_config.py.

Which HF tensor becomes which of our parameters is declared next to each block in models/ (`from_hf` /
`to_hf` static methods of the block classes in models/; models/gpt.py walks them). `transformers`
is needed only for the logits check and for export's config.json; `safetensors` for the weights (extra `hf`).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from models import gpt as gpt_module
from training.engine.build import TrainState
from training.interop import hf_deepseek, hf_mxfp4, safetensors_stream
from training.interop.hf_config import HFError, family
from training.parallel.wrap import unwrap

IGNORED_HF = re.compile(r".*rotary_emb\.inv_freq$")  # buffers some older checkpoints saved: recomputed
FP32_TOLERANCE, BF16_TOLERANCE = 1e-4, 5e-2  # max |logit diff| / max |logit| (bf16: 8 mantissa bits)


# ---- safetensors -------------------------------------------------------------------------------------------

class HFWeights:
    """The tensors of <dir>/model.safetensors or the shards named by model.safetensors.index.json, read on demand
    with pread(2) into a tensor of their own (one shard open, none memory-mapped: a mapped shard keeps every page
    read resident until it is closed, so --check on a one-file export held the whole model); remembers which were
    read. A tensor stored in MXFP4 (gpt-oss's experts: `name_blocks` and `name_scales`) is read as `name`,
    dequantized to bf16 (hf_mxfp4.py)."""

    DTYPES = {name: dtype for dtype, name in safetensors_stream.DTYPES.items()}  # safetensors' names -> torch's

    def __init__(self, directory: Path):
        from safetensors import safe_open

        index = directory / "model.safetensors.index.json"
        if index.is_file():
            files = json.loads(index.read_text())["weight_map"]
        elif (directory / "model.safetensors").is_file():
            with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
                files = dict.fromkeys(handle.keys(), "model.safetensors")
        else:
            raise HFError(f"{directory} has neither model.safetensors nor model.safetensors.index.json")
        self.directory, self.where, self.open = directory, files, (None, None)
        self.read: set[str] = set()
        if missing := sorted(f for f in set(files.values()) if not (directory / f).is_file()):
            raise HFError(f"{directory}: shards named in model.safetensors.index.json are missing: {missing[:4]}")
        config = directory / "config.json"  # its family names fused tensors (Phi-3's qkv_proj, gate_up_proj)
        hf = json.loads(config.read_text()) if config.is_file() else {}
        self.family = hf.get("model_type")
        if self.family == hf_deepseek.FAMILY:  # multi-token prediction layers: not imported (hf_deepseek.skipped)
            self.where = {k: v for k, v in self.where.items() if not hf_deepseek.mtp_tensor(hf, k)}

    def __contains__(self, name: str) -> bool:
        return name in self.where or self._mxfp4(name)

    def _mxfp4(self, name: str) -> bool:
        return name not in self.where and all(name + suffix in self.where for suffix in hf_mxfp4.SUFFIXES)

    def _handle(self, name: str):
        from safetensors import safe_open

        if name not in self.where:
            raise HFError(f"the Hugging Face checkpoint has no tensor {name!r}")
        file = self.where[name]
        if self.open[0] != file:
            self.open = (None, None)  # the previous shard's handle goes first
            self.open = (file, safe_open(str(self.directory / file), framework="pt", backend="pread"))
        return self.open[1]

    def __call__(self, name: str) -> torch.Tensor:
        if self._mxfp4(name):
            return hf_mxfp4.dequantize(*(self(name + suffix) for suffix in hf_mxfp4.SUFFIXES))
        tensor = self._handle(name).get_tensor(name)
        self.read.add(name)
        return tensor

    def header(self, name: str, mark: bool = True) -> tuple[list[int], torch.dtype]:
        """A tensor's shape and dtype from its shard's header (no data read)."""
        if self._mxfp4(name):
            for suffix in hf_mxfp4.SUFFIXES:
                self.header(name + suffix, mark)
            return hf_mxfp4.dequantized_shape(self.header(name + "_blocks", mark)[0]), torch.bfloat16
        view = self._handle(name).get_slice(name)
        if mark:
            self.read.add(name)
        return view.get_shape(), self.DTYPES[view.get_dtype()]

    def largest_shard(self) -> int:
        """The size in bytes of the largest safetensors file."""
        return max((self.directory / f).stat().st_size for f in set(self.where.values()))

    def dtype(self) -> torch.dtype:
        """The floating dtype of the checkpoint's weights (the first floating tensor's)."""
        return next(d for d in (self.header(n, mark=False)[1] for n in sorted(self.where)) if d.is_floating_point)

    def unread(self, tied: bool) -> list[str]:
        return sorted(k for k in self.where if k not in self.read and not IGNORED_HF.match(k)
                      and not (tied and k == "lm_head.weight"))


def write_safetensors(items, directory: Path, max_shard_bytes: int, progress=None) -> int:
    """Write (name, tensor) items as model.safetensors, or shards of at most max_shard_bytes + the index, one
    tensor in memory at a time (training/interop/safetensors_stream.py). Returns bytes."""
    return safetensors_stream.write(items, directory, max_shard_bytes, progress)


# ---- weights into / out of a built GPT (one process, tp=1, pp=1) ----------------------------------------------

def weights_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of `module` by name: its parameters and its persistent buffers (DeepSeek's router
    expert bias, Megatron-Core's `expert_bias`: updated from the load, not by the optimizer)."""
    named = dict(module.named_parameters())
    for prefix, mod in module.named_modules():
        named.update({f"{prefix}.{n}" if prefix else n: b for n, b in mod._buffers.items()
                      if b is not None and n not in mod._non_persistent_buffers_set})
    return named


def load_hf_weights(state: TrainState, get) -> int:
    """Copy HF tensors (get(name)) into this single-process model, every parameter exactly once; returns count."""
    gpt = unwrap(state.model[0])
    params = weights_of(gpt)
    count = 0
    with torch.no_grad():
        config = _with_family(gpt.config, getattr(get, "family", None))
        for name, tensor in _hf_errors(gpt_module.from_hf, get, config, state.shape):
            param = params.pop(name, None)
            if param is None or param.shape != tensor.shape:
                raise HFError(f"{name}: converted shape {tuple(tensor.shape)} does not fit the model's "
                              f"{None if param is None else tuple(param.shape)}")
            param.copy_(tensor)
            count += tensor.numel()
    if params:
        raise HFError(f"parameters the Hugging Face mapping does not fill: {sorted(params)}")
    if state.optimizer is not None:
        state.optimizer.reload_model_params()  # bf16: the fp32 main params follow
    return count


def hf_tensors(state: TrainState):
    """(HF name, full tensor) for every weight of this single-process model, vocab padding dropped."""
    gpt = unwrap(state.model[0])
    params = weights_of(gpt)
    config = _with_family(gpt.config, family(state.shape))  # the family export writes (hf_config.family)
    return _hf_errors(gpt_module.to_hf, lambda name: params[name].detach(), config, state.shape)


def _with_family(config, kind: str | None):
    """A copy of the model's TransformerConfig naming the HF family, for the blocks' from_hf / to_hf (Phi-3's
    fused qkv_proj and gate_up_proj: models/attention.py, models/mlp.py)."""
    config = copy.copy(config)
    config.hf_family = kind
    return config


def _hf_errors(walk, *args):
    """models/gpt.py's walk, its ValueErrors (a model Llama cannot express) as HFError."""
    try:
        yield from walk(*args)
    except ValueError as err:
        raise HFError(str(err)) from err


# ---- logits ------------------------------------------------------------------------------------------------

def full_logits(state: TrainState, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """The whole model's logits [b, s, vocab_size] (fp32) for tokens [b, s] at this run's layout, through
    Megatron-Core's pipeline schedule (forward only) with the TP vocab shards gathered; returned on the last
    pipeline stage's ranks, None on the others. Every rank of the job must call it."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if len(state.model) > 1:
        raise HFError("the logits check runs at parallel.vpp=null (the interleaved schedule needs a multiple of "
                      "pp micro-batches)")
    device = tokens.device

    def step(_, model):  # loss_func None: the schedule keeps the last stage's output as it is
        return model(tokens if unwrap(model).pre_process else None), None

    for chunk in state.model:
        chunk.eval()
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=step, data_iterator=None,
            model=state.model, num_microbatches=1, seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0],
            forward_only=True)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    local = outputs[0].float().to(device)  # [b, s, V_padded/tp]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:
        shards = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(shards, local, group=parallel_state.get_tensor_model_parallel_group())
        local = torch.cat(shards, dim=-1)
    return local[..., :vocab_size]


def reference_logits(hf_dir: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logits [b, s, V] (fp32) of a Hugging Face checkpoint directory."""
    import transformers

    dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = transformers.AutoModelForCausalLM.from_pretrained(  # eager: the oracle (Gemma 2's soft-cap needs it)
        str(hf_dir), attn_implementation="eager", **{dtype_key: torch.float32})
    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits.float()


def check_tokens(vocab_size: int, seq_length: int, batch: int = 2, length: int = 64) -> torch.Tensor:
    """Fixed pseudo-random token ids [batch, min(length, seq_length)] for the logits check."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (batch, min(length, seq_length)), generator=generator)


def logits_diff(ours: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(max |ours - reference|, the same divided by max |reference|)."""
    worst = (ours - reference).abs().max().item()
    return worst, worst / max(reference.abs().max().item(), 1e-12)
