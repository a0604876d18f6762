"""gpt-oss's MXFP4 experts (training/interop/hf_mxfp4.py): a hand-built block decodes to the values the format
defines (written out here from its definition), random blocks equal transformers' own dequantization bit for bit,
and a gpt-oss checkpoint with MXFP4 experts imports (tools/convert_hf.py import --check: transformers' model reads
the same dequantized experts; the logits agree) into bf16."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from hf_interop import ROOT, convert_main, relative_diff

if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("safetensors") is None:
    pytest.skip("needs the hf extra: pip install -e '.[hf]'", allow_module_level=True)


@pytest.mark.fast
def test_a_hand_built_block_decodes_to_the_formats_values():
    from training.interop.hf_mxfp4 import dequantize

    blocks = torch.zeros(1, 2, 1, 16, dtype=torch.uint8)  # [E 1, rows 2, G 1, 16 bytes]: 32 values a row
    blocks[0, 0, 0, :3] = torch.tensor([0x21, 0xF7, 0x8A], dtype=torch.uint8)
    blocks[0, 1, 0, 15] = 0x5B  # the row's last byte: values 30 (low nibble 0xB) and 31 (high nibble 0x5)
    scales = torch.tensor([[[128], [125]]], dtype=torch.uint8)  # 2 ** (128 - 127) = 2, 2 ** (125 - 127) = 1/4
    out = dequantize(blocks, scales)  # [1, 32, 2]: column r is row r's 32 values
    # row 0, scale 2: 0x21 -> low 1 (0.5), high 2 (1.0); 0xF7 -> low 7 (6.0), high 0xF (-6.0); 0x8A -> low 0xA
    # (-1.0), high 8 (-0.0)
    assert out[0, :6, 0].tolist() == [1.0, 2.0, 12.0, -12.0, -2.0, -0.0] and not out[0, 6:, 0].any()
    assert torch.signbit(out[0, 5, 0])  # negative zero
    # row 1, scale 1/4: 0x5B -> low 0xB (-1.5), high 5 (3.0)
    assert out[0, 30:, 1].tolist() == [-0.375, 0.75] and not out[0, :30, 1].any()
    assert out.dtype == torch.bfloat16


@pytest.mark.fast
def test_random_blocks_equal_transformers_dequantization():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from training.interop.hf_mxfp4 import dequantize

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (4, 96, 3, 16), generator=g, dtype=torch.uint8)  # [E, rows, G, 16]
    scales = torch.randint(110, 140, (4, 96, 3), generator=g, dtype=torch.uint8)  # [E, rows, G]
    ours = dequantize(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.bfloat16)
    assert ours.shape == theirs.shape == (4, 96, 96) and torch.equal(ours, theirs)


def test_an_mxfp4_gpt_oss_checkpoint_imports(tmp_path):
    """A random gpt-oss's experts replaced by MXFP4 blocks (as the published checkpoints store them) import
    with the logits check (bf16: the other tensors' dtype)."""
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64, pad_token_id=0,
        bos_token_id=None, eos_token_id=None, dtype="bfloat16")
    hf_dir = tmp_path / "hf"
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(str(hf_dir))
    tensors = load_file(str(hf_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, columns, rows = tensors.pop(name).shape  # [E, in, out]
        tensors[name + "_blocks"] = torch.randint(0, 256, (experts, rows, columns // 32, 16), generator=g,
                                                  dtype=torch.uint8)
        tensors[name + "_scales"] = torch.randint(118, 124, (experts, rows, columns // 32), generator=g,
                                                  dtype=torch.uint8)
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    published = json.loads((hf_dir / "config.json").read_text())
    published["quantization_config"] = {"quant_method": "mxfp4"}
    (hf_dir / "config.json").write_text(json.dumps(published))

    sys.path.insert(0, str(ROOT / "tools"))
    import convert_hf

    code, output, errors = convert_main(convert_hf, [
        "import", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "ckpt"), "--check",
        "--preset-out", str(tmp_path / "gpt_oss_mxfp4.yaml")])
    assert code == 0, output + errors
    assert "(bf16)" in output and "imported dequantized to bf16" in output, output
    assert relative_diff(output) <= 1e-5, output  # both models in fp32 from the same bf16 weights
