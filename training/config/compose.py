"""Compose conf/ outside `@hydra.main` (tools, tests, train.py's precheck): the same config train.py sees.

Hydra and OmegaConf report a value the schema refuses (a choice that is not one of the Enum's, a string
for an integer) as a multi-line exception; `compose` turns it into a one-line ConfigError that names the
key, the value and what is allowed. A key the schema lacks is refused with or without Hydra's `+` (which
would otherwise add it, unused): `unknown key 'paralel.tp' (did you mean parallel.tp?)`.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path

from training.config import aliases
from training.config.schema import Config, register, to_config
from training.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def one_line(err: BaseException) -> str:
    """`full_key: first line of the message` for OmegaConf errors (also when Hydra wraps them); a key the
    schema lacks (in a YAML file or a `{...}` value) is `unknown key ...` as for an override."""
    from omegaconf.errors import OmegaConfBaseException

    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else err
    message = (getattr(cause, "msg", None) or str(cause)).strip().splitlines()
    key = getattr(cause, "full_key", None)
    first = message[0] if message else type(cause).__name__
    if ambiguous := re.fullmatch(r"Ambiguous value for argument '([^=]+)=(.*)'", first):  # Hydra's advice: below
        key, value = ambiguous.groups()
        return (f"{key}={value}: a value with commas needs quotes (text, as data.split: \"{key}='{value}'\") or "
                f"brackets (a list: '{key}=[{value}]')")
    group = re.search(r"Could not find '(\w+)/([^']+)'", first)
    options = re.search(r"Available options in '\w+':\n((?:\t\S+\n?)+)", str(cause))
    if group and options:  # a config group's option that does not exist: Hydra lists the others on more lines
        name, choices = group.group(2), options.group(1).split()
        near = difflib.get_close_matches(name, choices, n=1)
        return (f"{group.group(1)}={name}: no such config in conf/{group.group(1)}/ ("
                + (f"did you mean {near[0]}? " if near else "") + f"choose from {', '.join(choices)})")
    if missing := re.search(r"Key '[^']*' not in '\w+'\s+full_key: (\S+)", str(cause)):  # a YAML's or a {...}'s key
        where = re.match(r"In '[^']+': ", first)
        return (where.group(0) if where else "") + unknown_key(missing.group(1))
    return f"{key}: {first}" if key and not first.startswith(key) else first


def schema_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, nodes (`model.moe`) and leaves (`model.moe.top_k`)."""
    keys = []
    for f in dataclasses.fields(cls):
        keys.append(prefix + f.name)
        if dataclasses.is_dataclass(f.default_factory):
            keys += schema_keys(f.default_factory, f"{prefix}{f.name}.")
    return keys


def unknown_key(key: str) -> str:
    """`unknown key 'key' (did you mean <nearest>?)`: nearest by the whole key, else by its last part."""
    keys = schema_keys()
    if hint := aliases.exact(key):  # another framework's name: tensor_model_parallel_size, learning_rate
        return f"unknown key '{key}' ({hint})"
    near = difflib.get_close_matches(key, keys, n=1, cutoff=0.8)  # a typo of ours: paralel.tp
    if not near and (hint := aliases.alias(key)):  # parallel.tensor_parallel -> parallel.tp
        return f"unknown key '{key}' ({hint})"
    near = near or difflib.get_close_matches(key, keys, n=1)
    if not near:  # `tp=2` -> parallel.tp
        leaves = {k.rsplit(".", 1)[-1]: k for k in reversed(keys)}
        near = [leaves[m] for m in difflib.get_close_matches(key.rsplit(".", 1)[-1], list(leaves), n=1)]
    hint = f"did you mean {near[0]}?" if near else "the keys are in training/config/schema.py"
    return f"unknown key '{key}' ({hint})"


def check_keys(overrides: list[str]) -> None:
    """Refuse an override whose key is not in the schema: not hydra.*, not a config group (model=qwen3_8b)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    known = set(schema_keys())
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group
        if (CONF_DIR / key).is_dir() and override.is_add():  # Hydra: "Multiple values for experiment. ..."
            raise ConfigError(f"'+{key}=...' adds a config group, but {key} is already one (conf/config.yaml's "
                              f"defaults): write {override.input_line.lstrip('+')}")
        if override.is_hydra_override() or key == "hydra" or "/" in key or (CONF_DIR / key).is_dir():
            continue
        if key not in known:
            raise ConfigError(unknown_key(key))


def compose(overrides: list[str] | tuple[str, ...] = ()) -> Config:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register()
    try:
        check_keys(list(overrides))
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            composed = hydra_compose(config_name="config", overrides=list(overrides))
        return to_config(composed)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(one_line(err)) from err
