"""A save is one decision of every rank: each step of it ends with every rank learning which ranks failed and
why, or, where a rank fails alone inside a collective its peers are waiting in, with that rank leaving at once.

    failures = agree(attempt(prepare) if rank0 else None)   # {} when every rank succeeded; every rank calls it
    failures = agree(write_shards(save, path, latest))      # the format's save (Megatron-Core / torch DCP)

Where a failure on one rank surfaces (Megatron-Core 0.19.2, torch DCP; measured with one rank's write failing):
- a rank's shard write (a full disk, a permission): DCP gathers every rank's write results and raises a
  CheckpointException on every rank (only the coordinator holds the causes; the failing rank's own cause is
  only in its writer's error log, caught here): an agreed failure, every rank reaches agree().
- the coordinator's own files in Megatron-Core's save (`.metadata`, metadata.json, the integrity manifest) are
  written between collectives (the write-results broadcast, then barriers): an OSError there is raised on rank
  0 alone while its peers wait in the next collective. Before, every rank then waited until
  parallel.timeout_minutes. Now that rank raises at once (CheckpointError naming it) and joins no further
  collective: its exit ends its peers' collectives (gloo: the connection closes, and they leave
  PEER_EXIT_SECONDS later; torchrun stops the others as soon as one rank exits, and kills them 30 s later if
  they are stuck, e.g. in NCCL).
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import time
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from training.checkpoint.common import CheckpointError, describe

# torchrun reports only the ranks that exited before it stopped the rest: a rank whose save broke because a peer
# failed alone leaves this long after its error, so the peer that failed first (still exiting) is the one named
PEER_EXIT_SECONDS = 10.0
WRITER_LOG = "megatron.core.dist_checkpointing"  # its writer logs a failed write at ERROR, then hides the cause
_WORKER = re.compile(r"^Local worker \d+ encountered an error: ")


def attempt(step, *args) -> dict[int, str] | None:
    """step(*args) on this rank: None if it succeeded, else {this rank: the cause}."""
    try:
        step(*args)
        return None
    except OSError as err:
        return {dist.get_rank(): describe(err)}


def agree(local: dict[int, str] | None) -> dict[int, str]:
    """Every rank's outcome of the step to every rank (one all-gather): {failed rank: its cause}, empty when
    every rank succeeded. A rank's own account of itself wins over what another rank reported about it."""
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, local)
    failures: dict[int, str] = {}
    for source, outcome in enumerate(outcomes):
        for rank, cause in (outcome or {}).items():
            if rank == source or rank not in failures:
                failures[rank] = cause
    if not failures:  # ranks that failed without knowing why (none said which rank failed)
        failures = {rank: "cause unknown" for rank, outcome in enumerate(outcomes) if outcome is not None}
    return dict(sorted(failures.items()))


def on_ranks(failures: dict[int, str]) -> str:
    """"rank 1 (OSError: ...)", or "ranks 0, 1 (rank 0: ...; rank 1: ...)" (one cause when they agree)."""
    causes = set(failures.values())
    if len(failures) == 1 or len(causes) == 1:
        ranks = ", ".join(map(str, failures))
        return f"rank{'s' * (len(failures) > 1)} {ranks} ({causes.pop()})"
    return f"ranks {', '.join(map(str, failures))} (" + "; ".join(f"rank {r}: {c}" for r, c in failures.items()) + ")"


class _WriterErrors(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(_WORKER.sub("", record.getMessage()))


@contextlib.contextmanager
def _writer_errors():
    handler = _WriterErrors()
    logger = logging.getLogger(WRITER_LOG)
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


def write_shards(save, path: Path, latest: str) -> dict[int, str] | None:
    """save() (every rank's shards, the format's metadata): None, or this rank's account of an agreed failure;
    raises CheckpointError at once when this rank failed alone (an OSError: see the module's docstring),
    after removing the partial directory (rank 0); any other exception (most often a collective broken by a
    peer that failed alone) is raised again PEER_EXIT_SECONDS later."""
    rank = dist.get_rank()
    with _writer_errors() as logged:
        try:
            save()
            return None
        except CheckpointException as err:  # raised on every rank (DCP gathered the outcomes)
            known = {r: describe(failure[0] if isinstance(failure, tuple) else failure)
                     for r, failure in err.failures.items()}
            return {**known, rank: logged[0]} if logged else known
        except OSError as err:  # this rank alone, between collectives its peers are already waiting in
            _remove(path, rank)
            raise CheckpointError(f"saving checkpoint {path} failed on rank {rank} ({describe(err)}); latest stays "
                                  f"{latest}: every rank stops (a failure on one rank inside the save's collectives "
                                  f"cannot wait for checkpoint.on_save_error=warn)", rank=rank) from err
        except Exception:  # a collective broken by a peer that failed alone (gloo: "Connection closed by peer")
            _remove(path, rank)
            time.sleep(PEER_EXIT_SECONDS)  # that peer exits first, so torchrun names it, not this rank
            raise
        except BaseException:
            _remove(path, rank)
            raise


def _remove(path: Path, rank: int) -> None:
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)  # never complete, never latest
