"""Errors the user can act on. train.py prints them as one line (no traceback) and exits 2."""


class TemplateError(RuntimeError):
    """Base class: a problem with the user's config, data, checkpoint or environment."""


class ConfigError(TemplateError):
    """An invalid or inconsistent configuration, found before any process group exists."""


class LaunchError(TemplateError):
    """The processes were started in a way that cannot work (world size, missing env, busy port)."""
