"""Compose conf/ outside `@hydra.main` (tools, tests): the same config train.py would see."""

from __future__ import annotations

from pathlib import Path

from training.config import Config, register, to_config

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose(overrides: list[str] | tuple[str, ...] = ()) -> Config:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = hydra_compose(config_name="config", overrides=list(overrides))
    return to_config(composed)
