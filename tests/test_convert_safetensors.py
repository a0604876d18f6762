"""The streamed safetensors writer (training/interop/safetensors_stream.py, what export writes): byte for byte what
safetensors' own save_file writes for the same tensors (its order: by dtype, then by name, whatever order they
arrive in), sharded as export always sharded, and an empty file for no tensors. No model, no Megatron-Core."""

import json

import pytest
import torch

pytest.importorskip("safetensors")


def _items() -> list[tuple[str, torch.Tensor]]:
    """Tensors in a walk's order (not sorted), of the dtypes an export writes (bf16 weights, an fp32 router bias,
    fp16, ints, bools), views among them (a slice, a transpose) and a 0-d tensor."""
    g = torch.Generator().manual_seed(0)
    fc1 = torch.randn(8, 6, generator=g).to(torch.bfloat16)
    return [("model.embed_tokens.weight", torch.randn(11, 6, generator=g).to(torch.bfloat16)),
            ("model.layers.0.mlp.gate.e_score_correction_bias", torch.randn(4, generator=g)),
            ("model.layers.0.mlp.up_proj.weight", fc1[4:]), ("model.layers.0.mlp.gate_proj.weight", fc1[:4]),
            ("model.layers.0.self_attn.o_proj.weight", torch.randn(6, 5, generator=g).to(torch.bfloat16).t()),
            ("model.layers.1.input_layernorm.weight", torch.randn(6, generator=g).half()),
            ("a.step", torch.tensor(7)), ("b.mask", torch.tensor([True, False, True])),
            ("c.ids", torch.arange(5, dtype=torch.int32)), ("lm_head.weight", torch.randn(11, 6).to(torch.bfloat16))]


def test_stream_writer_is_save_file_byte_for_byte(tmp_path):
    """One shard and 100-byte shards (several tensors a shard, the index's weight map and total size): each file equal
    to save_file(the tensors the index puts in it, metadata format pt), bytes compared."""
    from safetensors.torch import save_file

    from training.interop import safetensors_stream

    items = _items()
    for name, limit in (("one", 1 << 30), ("many", 100)):
        out = tmp_path / name
        out.mkdir()
        assert safetensors_stream.write(iter(items), out, limit) == sum(t.nbytes for _, t in items)
        if name == "one":
            files = {"model.safetensors": [n for n, _ in items]}
        else:
            index = json.loads((out / "model.safetensors.index.json").read_text())
            assert index["metadata"]["total_size"] == sum(t.nbytes for _, t in items)
            files = {}
            for tensor, file in index["weight_map"].items():
                files.setdefault(file, []).append(tensor)
            assert len(files) > 3 and max(map(len, files.values())) >= 4, files
        tensors = dict(items)
        for file, names in files.items():
            save_file({n: tensors[n].contiguous() for n in names}, str(tmp_path / "expected"),
                      metadata={"format": "pt"})
            assert (out / file).read_bytes() == (tmp_path / "expected").read_bytes(), (name, file, names)
        assert sorted(f.name for f in out.iterdir()) == sorted([*files, *(["model.safetensors.index.json"]
                                                                       if name == "many" else [])])

    (tmp_path / "empty").mkdir()
    safetensors_stream.write(iter([]), tmp_path / "empty", 1 << 30)
    save_file({}, str(tmp_path / "expected"), metadata={"format": "pt"})
    assert (tmp_path / "empty" / "model.safetensors").read_bytes() == (tmp_path / "expected").read_bytes()
