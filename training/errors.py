"""Errors the user can act on, and the one way every entry point reports them: one `error: ...` line per
problem on stderr, no traceback, exit code 2.

    sys.exit(exit_on_error(main, argv))        # tools/*.py and train.py

Which rank prints: an error raised alike on every rank (the config, data every rank checked, a failure every
rank agreed on) is printed by global rank 0 alone, so it is said once. An error a rank raised alone says so
(`TemplateError(..., rank=N)`, its message naming the rank) and is printed by that rank. Under the launch
scripts (EVERY_RANK set by launch/common.sh) every other rank prints its errors too, as `error: rank N: ...`:
the launcher shows such a line only if rank 0 did not say the same (an error that only rank N hit, e.g. data
only its pipeline stage reads), so an error is never lost and never said twice.
"""

from __future__ import annotations

import os
import sys

EVERY_RANK = "TEMPLATE_ERRORS_FROM_EVERY_RANK"  # set to 1 by launch/common.sh (its filter collapses repeats)


class TemplateError(RuntimeError):
    """Base class: a problem with the user's config, data, checkpoint or environment. rank: the one rank that
    raised it, when its peers did not (its message names the rank)."""

    def __init__(self, *args, rank: int | None = None):
        super().__init__(*args)
        self.rank = rank


class ConfigError(TemplateError):
    """An invalid or inconsistent configuration, found before any process group exists."""


class LaunchError(TemplateError):
    """The processes were started in a way that cannot work (world size, missing env, busy port)."""


def print_error(err: BaseException) -> None:
    rank = os.environ.get("RANK", "0")
    if getattr(err, "rank", None) is not None or rank == "0":
        prefix = ""
    elif os.environ.get(EVERY_RANK) == "1":
        prefix = f"rank {rank}: "
    else:
        return
    lines = str(err).splitlines() or [type(err).__name__]
    # one write: under launch/common.sh (PYTHONUNBUFFERED=1) print's text and its newline are two, and a peer
    # rank's line sharing the pipe can land between them (`error: rank 1: Xerror: X`, then an empty line)
    sys.stderr.write("".join(f"error: {prefix}{line}\n" for line in lines))
    sys.stderr.flush()


def exit_on_error(fn, *args, also: tuple[type[BaseException], ...] = ()) -> int:
    """fn(*args) -> its exit code (None = 0); a TemplateError, or an exception of a type in `also`, is
    printed as one line per problem and gives 2."""
    try:
        return fn(*args) or 0
    except (TemplateError, *also) as err:
        print_error(err)
        return 2
