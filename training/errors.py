"""Errors the user can act on, and the one way every entry point reports them: one `error: ...` line per
problem on stderr (global rank 0 only), no traceback, exit code 2.

    sys.exit(exit_on_error(main, argv))        # tools/*.py and train.py
"""

from __future__ import annotations

import os
import sys


class TemplateError(RuntimeError):
    """Base class: a problem with the user's config, data, checkpoint or environment."""


class ConfigError(TemplateError):
    """An invalid or inconsistent configuration, found before any process group exists."""


class LaunchError(TemplateError):
    """The processes were started in a way that cannot work (world size, missing env, busy port)."""


def print_error(err: BaseException) -> None:
    if os.environ.get("RANK", "0") == "0":
        lines = str(err).splitlines() or [type(err).__name__]
        print("\n".join(f"error: {line}" for line in lines), file=sys.stderr, flush=True)


def exit_on_error(fn, *args, also: tuple[type[BaseException], ...] = ()) -> int:
    """fn(*args) -> its exit code (None = 0); a TemplateError, or an exception of a type in `also`, is
    printed as one line per problem and gives 2."""
    try:
        return fn(*args) or 0
    except (TemplateError, *also) as err:
        print_error(err)
        return 2
