"""tools/convert_hf.py import --hf-dir OWNER/NAME: a hub id resolves through huggingface_hub's cache (offline here:
HF_HUB_OFFLINE=1 and a cache laid out as the hub client writes it, refs/main -> snapshots/<commit>/), the preset is
named after the repository, and what cannot be resolved is one line, exit 2. --help lists every family import
takes, as docs/hf.md's table does."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hf_interop import ARCH, ROOT

if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("huggingface_hub") is None:
    pytest.skip("needs the hf extra: pip install -e '.[hf]'", allow_module_level=True)

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache(root: Path) -> Path:
    """A hub cache holding test-org/Hub-Test-Llama at main (a random HF Llama, saved as from_pretrained reads it)."""
    import torch
    import transformers

    torch.manual_seed(5)
    repo = root / "hub" / "models--test-org--Hub-Test-Llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**ARCH)).save_pretrained(repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return root / "hub"


def _convert(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/convert_hf.py", "import", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_import_from_a_hub_id_offline_from_the_cache(tmp_path):
    env = dict(os.environ, HF_HUB_CACHE=str(_cache(tmp_path)), HF_HUB_OFFLINE="1")
    out, preset = tmp_path / "ckpt", ROOT / "conf" / "model" / "local" / "hub_test_llama.yaml"  # the default place
    try:
        done = _convert(["--hf-dir", "test-org/Hub-Test-Llama", "--out", str(out)], env)
        text = preset.read_text()
    finally:
        preset.unlink(missing_ok=True)
        if preset.parent.is_dir() and not any(preset.parent.iterdir()):
            preset.parent.rmdir()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "train it with: model=local/hub_test_llama " in done.stdout, done.stdout
    assert (out / "latest").read_text().strip() == "iter_0000000"
    header = text.splitlines()[0]
    assert f"imported from test-org/Hub-Test-Llama@main ({tmp_path}/hub/models--test-org--Hub-Test-Llama/snapshots/{COMMIT})" \
        in header, header
    assert f"num_layers: {ARCH['num_hidden_layers']}" in text

    for args, line in ((["--hf-dir", "test-org/Missing"], "--hf-dir test-org/Missing: not in the Hugging Face cache"),
                       (["--hf-dir", "test-org/Hub-Test-Llama", "--revision", "v9"],
                        "--hf-dir test-org/Hub-Test-Llama --revision v9: not in the Hugging Face cache"),
                       (["--hf-dir", str(tmp_path / "hub"), "--revision", "v9"], "--revision v9 needs a hub id")):
        refused = _convert([*args, "--out", str(tmp_path / "refused")], env)
        last = refused.stderr.strip().splitlines()[-1]
        assert refused.returncode == 2 and last.startswith("error: ") and line in last, refused.stderr[-2000:]
        assert not (tmp_path / "refused").exists()


@pytest.mark.fast
def test_help_lists_every_family_docs_hf_md_lists():
    from training.interop.hf_config import FAMILIES

    shown = subprocess.run([sys.executable, "tools/convert_hf.py", "import", "--help"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120).stdout
    table = (ROOT / "docs" / "hf.md").read_text().split("| family (`model_type`)")[1].split("\n\n")[0]
    documented = {kind for row in table.splitlines()[2:] for kind in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert set(FAMILIES) == documented, (FAMILIES, documented)
    assert all(kind in " ".join(shown.split()) for kind in FAMILIES), shown
