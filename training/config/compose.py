"""Compose conf/ outside `@hydra.main` (tools, tests, train.py's precheck): the same config train.py sees.

Hydra and OmegaConf report a value the schema refuses (a choice that is not one of the Enum's, a string
for an integer, an unknown key) as a multi-line exception; `compose` turns it into a one-line ConfigError
that names the key, the value and what is allowed.
"""

from __future__ import annotations

from pathlib import Path

from training.config.schema import Config, register, to_config
from training.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def one_line(err: BaseException) -> str:
    """`full_key: first line of the message` for OmegaConf errors (also when Hydra wraps them)."""
    from omegaconf.errors import OmegaConfBaseException

    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else err
    message = (getattr(cause, "msg", None) or str(cause)).strip().splitlines()
    key = getattr(cause, "full_key", None)
    first = message[0] if message else type(cause).__name__
    if key and not first.startswith(key):
        first = f"{key}: {first}"
    hint = next((line for line in str(err).splitlines() if line.startswith("To append")), None)
    return f"{first} ({hint[0].lower() + hint[1:]})" if hint else first


def compose(overrides: list[str] | tuple[str, ...] = ()) -> Config:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            composed = hydra_compose(config_name="config", overrides=list(overrides))
        return to_config(composed)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(one_line(err)) from err
