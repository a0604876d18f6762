"""A Hugging Face hub id (`Qwen/Qwen3-8B`) where a tool takes a model directory: `huggingface_hub` downloads what a
conversion reads (config.json, the safetensors, the tokenizer and chat template files; not the .bin / .pth /
GGUF duplicates many repositories carry) into its cache, with its progress bars, its token (`hf auth login` or
HF_TOKEN, for gated models such as Llama) and its offline mode (HF_HUB_OFFLINE=1: the cache only), and returns the
snapshot directory. A path that exists is used as it is; so is anything that is not shaped like a hub id.
"""

from __future__ import annotations

import re
from pathlib import Path

from training.interop.hf_config import HFError

# what import (and import --adapter) reads; the rest of a repository is never fetched
WANTED = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name, as the hub spells repository ids


def is_hub_id(value: str) -> bool:
    """`owner/name` that is not a path on this machine (a local `ckpts/x` wins over a repository of that name)."""
    return bool(HUB_ID.fullmatch(value)) and not Path(value).expanduser().exists() and not value.startswith(".")


def model_dir(value: str, revision: str | None = None, flag: str = "--hf-dir") -> Path:
    """The local directory for `value`: itself, or the cached snapshot of hub id `value` at `revision`."""
    if not is_hub_id(value):
        if revision:
            raise HFError(f"--revision {revision} needs a hub id as {flag} (got the directory {value})")
        return Path(value).expanduser()
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError as err:
        raise HFError(f"{flag} {value} is a hub id, which needs huggingface_hub: pip install -e '.[hf]'") from err
    where = f"{flag} {value}" + (f" --revision {revision}" if revision else "")
    try:
        return Path(huggingface_hub.snapshot_download(value, revision=revision, allow_patterns=WANTED))
    except errors.GatedRepoError as err:
        raise HFError(f"{where}: a gated model: accept its licence on huggingface.co/{value}, then log in "
                      f"(hf auth login) or set HF_TOKEN") from err
    except errors.RepositoryNotFoundError as err:
        raise HFError(f"{where}: no such repository on the hub (or it is private: log in with hf auth login or "
                      f"set HF_TOKEN); a local directory of that name does not exist either") from err
    except errors.RevisionNotFoundError as err:
        raise HFError(f"{where}: the repository has no such revision (a branch, tag or commit)") from err
    except errors.LocalEntryNotFoundError as err:
        raise HFError(f"{where}: not in the Hugging Face cache ({huggingface_hub.constants.HF_HUB_CACHE}) and the "
                      f"hub cannot be reached (HF_HUB_OFFLINE={huggingface_hub.constants.HF_HUB_OFFLINE:d}): "
                      f"download it where there is a network, or pass a local directory") from err
