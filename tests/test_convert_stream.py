"""Streamed Hugging Face import / export (tools/convert_hf.py; training/interop/hf_stream.py, ckpt_reader.py,
hf_check.py): bf16 in, bf16 out, bit-identical across many safetensors shards with a complete index; the import
loads at tp2 and pp2 with transformers' logits; and the peak resident memory of import and export --check grows
with the largest shard and tensor, not with the model (a model 10x the bound's slack stays under it)."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from hf_interop import ARCH, ROOT, VOCAB, convert_main, logits_at_layouts

sys.path.insert(0, str(ROOT / "tools"))


@pytest.fixture(autouse=True)
def _environment():
    """convert_hf runs in this process here and sets RANK / WORLD_SIZE (a world of one): restore the environment,
    else every later test's tool would think it runs under torchrun with one process."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _hf_llama(path: Path, shard: str, **arch) -> None:
    """A random transformers Llama in bf16 (norm weights random too), saved in shards of at most `shard`."""
    import transformers

    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**ARCH, "tie_word_embeddings": False, **arch}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
    model.to(torch.bfloat16).save_pretrained(str(path), max_shard_size=shard)


def _tensors(path: Path) -> dict:
    """Every tensor of an HF directory, through its index: {name: tensor}; the index checked complete (each
    tensor listed once, in an existing file, total_size the tensors' bytes)."""
    from safetensors import safe_open

    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / file), framework="pt") as handle:
            for name in handle.keys():
                assert index["weight_map"].get(name) == file, (name, file)
                tensors[name] = handle.get_tensor(name)
    assert sorted(tensors) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert not list(path.glob("*.tmp")), "temporary shards left"
    return tensors


def _stored_as(iteration: Path, dtype: torch.dtype) -> None:
    """Every tensor the checkpoint's metadata records is `dtype`, and its .distcp files hold those tensors' bytes
    (+ 1% and 128 KiB for DCP's per-file headers and the pickled non-tensor entries): fp32 written for a bf16
    model would double the disk and still load back equal."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors = {k: v for k, v in FileSystemReader(str(iteration)).read_metadata().state_dict_metadata.items()
               if isinstance(v, TensorStorageMetadata)}
    assert tensors and {v.properties.dtype for v in tensors.values()} == {dtype}, \
        {k: v.properties.dtype for k, v in tensors.items()}
    stored = sum(v.size.numel() * dtype.itemsize for v in tensors.values())
    on_disk = sum(f.stat().st_size for f in iteration.glob("*.distcp"))
    assert stored <= on_disk <= 1.01 * stored + 128 * 1024, (stored, on_disk)  # measured: +70 KB of 345 KB


def test_bf16_round_trip_across_shards_and_loads_at_tp2_pp2(tmp_path):
    """A bf16 Llama in 9 shards (its layers split across files) -> import (the checkpoint stays bf16) -> export in
    ~20 KB shards: every tensor bit-identical and bf16, both indexes complete, config.json bf16; the import at tp2
    and at pp2 gives transformers' logits (fp32 compute of the same bf16 weights, <= 1e-5 relative)."""
    import convert_hf

    from training.interop.hf import check_tokens, reference_logits

    _hf_llama(tmp_path / "hf", "40KB")
    code, out, err = convert_main(convert_hf, ["import", "--hf-dir", str(tmp_path / "hf"), "--out",
                                               str(tmp_path / "ckpt"), "--preset-out",
                                               str(tmp_path / "conf" / "model" / "streamed.yaml")])
    assert code == 0, err
    assert "(bf16)" in out
    _stored_as(tmp_path / "ckpt" / "iter_0000000", torch.bfloat16)
    code, out, err = convert_main(convert_hf, ["export", "--ckpt", str(tmp_path / "ckpt"), "--out",
                                               str(tmp_path / "exported"), "--max-shard-gb", "0.00002"])
    assert code == 0, err
    source, exported = _tensors(tmp_path / "hf"), _tensors(tmp_path / "exported")
    assert len(set(json.loads((tmp_path / "exported" / "model.safetensors.index.json").read_text())
                   ["weight_map"].values())) > 5
    assert sorted(source) == sorted(exported)
    for name, tensor in source.items():
        assert exported[name].dtype == torch.bfloat16 and torch.equal(exported[name], tensor), name
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["dtype"] == "bfloat16"

    tokens = check_tokens(VOCAB, ARCH["max_position_embeddings"])
    reference = reference_logits(tmp_path / "hf", tokens)
    jobs = [(layout, str(tmp_path / "conf"), str(tmp_path / "ckpt"), ["model=streamed", *overrides])
            for layout, overrides in {"tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"]}.items()]
    got = {}
    for result in run_distributed(logits_at_layouts, 2, args=(jobs, tokens)):
        got.update(result)
    for layout in ("tp2", "pp2"):
        relative = (got[layout] - reference).abs().max() / reference.abs().max()
        assert relative <= 1e-5, (layout, relative.item())


def test_interrupted_export_leaves_no_directory(tmp_path, monkeypatch):
    """An export that fails part-way (here: the third tensor cannot be written) removes its --out: no shards,
    no config.json, nothing that loads as a model; the same command then runs. (The import, of the bf16 model with
    train.precision=fp32, stores fp32: the override wins over the safetensors' dtype.)"""
    import convert_hf

    from training.interop import hf

    _hf_llama(tmp_path / "hf", "40KB")
    assert convert_main(convert_hf, ["import", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"),
                                     "--preset-out", str(tmp_path / "p.yaml"), "train.precision=fp32"])[0] == 0
    _stored_as(tmp_path / "ckpt" / "iter_0000000", torch.float32)
    writer = hf.write_safetensors

    def failing(items, *args, **kwargs):
        def some():
            for i, item in enumerate(items):
                if i == 2:
                    raise OSError(28, "No space left on device")
                yield item
        return writer(some(), *args, **kwargs)

    monkeypatch.setattr(hf, "write_safetensors", failing)
    argv = ["export", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "exported"), "--max-shard-gb",
            "0.00002"]
    code, _, err = convert_main(convert_hf, argv)
    assert code == 2 and err.count("error: ") == 1 and "No space left" in err, err
    assert not (tmp_path / "exported").exists()
    monkeypatch.setattr(hf, "write_safetensors", writer)
    assert convert_main(convert_hf, argv)[0] == 0


def _max_rss(argv: list[str]) -> int:
    """tools/convert_hf.py argv in a child process: its peak resident memory in bytes (tools/bench_convert.py's
    measurement: the child's own VmHWM)."""
    import bench_convert

    return bench_convert.measured(argv)[1]


@pytest.mark.slow
def test_memory_grows_with_the_largest_shard_not_the_model(tmp_path):
    """Peak RSS of import, of export into one shard (the whole model: written tensor by tensor, not held until
    full) and of export --check into one shard (then both models' logits module by module, transformers' weights
    read from that one file) for a 32-layer bf16 model of ~215 MB, minus the same commands' on a 4-layer model of
    the same vocabulary (Python, torch, Megatron-Core, transformers: the fixed cost), stays below the largest
    input shard + 2 x the largest tensor at fp32 + 64 MiB (export: 2 x the largest in bf16 + 64 MiB), under half
    the model, where holding it once (or mapping the file it reads) would add its 215 MB. Measured: the message."""
    arch = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2,
                vocab_size=4096, max_position_embeddings=64)
    rows = {}
    for name, layers in (("small", 4), ("large", 32)):
        _hf_llama(tmp_path / name, "16MB", num_hidden_layers=layers, **arch)
        export = ["export", "--ckpt", str(tmp_path / f"{name}_ckpt"), "--max-shard-gb", "1"]
        rows[name] = {
            "import": _max_rss(["import", "--hf-dir", str(tmp_path / name), "--out", str(tmp_path / f"{name}_ckpt"),
                                "--preset-out", str(tmp_path / f"{name}.yaml")]),
            "export": _max_rss([*export, "--out", str(tmp_path / f"{name}_one")]),
            "export --check": _max_rss([*export, "--out", str(tmp_path / f"{name}_checked"), "--check"])}
    assert [f.name for f in (tmp_path / "large_checked").glob("*.safetensors")] == ["model.safetensors"]
    model_bytes = sum(f.stat().st_size for f in (tmp_path / "large").glob("*.safetensors"))
    largest_shard = max(f.stat().st_size for f in (tmp_path / "large").glob("*.safetensors"))
    embedding = arch["vocab_size"] * arch["hidden_size"]
    slack = largest_shard + 2 * 4 * embedding + 64 * 2**20
    bounds = {"import": slack, "export": 2 * 2 * embedding + 64 * 2**20, "export --check": slack}
    message = (f"model {model_bytes / 2**20:.0f} MiB, largest shard {largest_shard / 2**20:.1f} MiB, slack "
               f"{slack / 2**20:.0f} MiB; peak RSS small/large: " + ", ".join(
                   f"{step} {rows['small'][step] / 2**20:.0f}/{rows['large'][step] / 2**20:.0f} MiB"
                   for step in bounds))
    print(message)
    assert model_bytes > 2 * slack, message  # holding the model would break the bounds
    for step, bound in bounds.items():
        grew = rows["large"][step] - rows["small"][step]
        assert grew < bound, f"{step} grew {grew / 2**20:.0f} MiB (bound {bound / 2**20:.0f}): {message}"
