"""The multi-process test harness and distributed init/teardown (training/parallel/dist.py)."""

import os
import time

import pytest
from harness import run_distributed


def _fail_on_rank_one():
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("boom from rank one")
    return "ok"


def test_harness_reports_the_failing_rank_with_its_traceback():
    with pytest.raises(AssertionError) as err:
        run_distributed(_fail_on_rank_one, 2, timeout=60)
    text = str(err.value)
    assert "--- rank 1 ---" in text and "ValueError: boom from rank one" in text and "Traceback" in text
    assert "--- rank 0 ---" not in text


def _hang_on_rank_zero():
    import os

    if os.environ["RANK"] == "0":
        time.sleep(600)
    return "done"


HANG_TIMEOUT = 30  # s: rank 1 (spawn + imports, ~5 s) must finish well inside it, also on a loaded 2-core machine


def test_harness_reports_a_hang_as_a_timeout():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=rf"ranks \[0\] did not finish within {HANG_TIMEOUT} s"):
        run_distributed(_hang_on_rank_zero, 2, timeout=HANG_TIMEOUT)
    assert time.monotonic() - start < HANG_TIMEOUT + 60  # the hung rank is killed, not waited for


def _peer_fails_inside_distributed():
    import os

    import torch
    import torch.distributed as dist

    from training.parallel import dist as D

    start = time.monotonic()
    try:
        with D.distributed(tp=1, timeout_minutes=5):
            if os.environ["RANK"] == "1":
                raise RuntimeError("rank 1 fails before the collective")
            dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that is gone
    except RuntimeError as err:
        return {"error": str(err).splitlines()[0], "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def test_a_failing_rank_does_not_leave_its_peers_hanging():
    """Rank 1 raises inside `distributed()`: it tears down without a barrier, so rank 0's pending
    collective fails quickly instead of waiting out the 5-minute collective timeout."""
    results = run_distributed(_peer_fails_inside_distributed, 2, timeout=120)
    assert results[1]["error"] == "rank 1 fails before the collective"
    assert results[0]["error"] is not None, "rank 0's collective should fail once its peer is gone"
    assert results[0]["seconds"] < 60


def test_world_size_not_divisible_is_one_line():
    from training.errors import LaunchError
    from training.parallel.dist import check_layout
    from training.parallel.layout import Layout

    with pytest.raises(LaunchError) as err:
        check_layout(Layout(6, tp=4))
    assert "\n" not in str(err.value) and "world size 6" in str(err.value) and "4 * 1 = 4" in str(err.value)
    with pytest.raises(LaunchError, match=r"tp \* pp \* cp = 1 \* 1 \* 4 = 4"):
        check_layout(Layout(6, cp=4))


def _exits(code: int, after: float, marker: str | None = None) -> None:
    time.sleep(after)
    if marker:
        open(marker, "w").write("printed")  # what a rank's error line would be
    raise SystemExit(code)


def test_a_tools_workers_end_on_their_own_before_the_first_failure_is_reported(tmp_path):
    """training/parallel/launch_local.wait_all: rank 1 fails first, rank 0 (which prints an error raised on every
    rank) ends 2 s later and is not killed before; a peer that never ends is terminated after the grace."""
    import multiprocessing

    from training.parallel.launch_local import wait_all

    fork = multiprocessing.get_context("fork")
    marker = str(tmp_path / "rank0")
    workers = [fork.Process(target=_exits, args=(2, 2.0, marker)), fork.Process(target=_exits, args=(2, 0.0))]
    for worker in workers:
        worker.start()
    assert wait_all(workers) == 2 and os.path.exists(marker)
    workers = [fork.Process(target=_exits, args=(0, 600.0)), fork.Process(target=_exits, args=(3, 0.0))]
    for worker in workers:
        worker.start()
    started = time.monotonic()
    assert wait_all(workers, grace=1.0) == 3 and workers[0].exitcode == -15
    assert time.monotonic() - started < 60  # the grace, not the peer's 600 s
