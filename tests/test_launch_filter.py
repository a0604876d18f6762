"""launch/common.sh's filter and summary from a recorded torchrun report, fed by a stand-in for torchrun (a second
each): the races a real run cannot force (a rank's error followed by a peer's traceback; a killed rank that
torchrun did not see fail first; an error from rank 1 alone, or from both ranks, rank 1's copy first), and which
rank prints an error (training/errors.py). The real launches: tests/test_launch_summary.py.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AGENT = "W1202 07:12:25.561000 29926 torch/distributed/elastic/multiprocessing/api.py"
TORCHRUN_TRACEBACK = """Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "<frozen runpy>", line 88, in _run_code
  File "/venv/lib/python3.12/site-packages/torch/distributed/run.py", line 1142, in <module>
    main()
  File "/venv/lib/python3.12/site-packages/torch/distributed/launcher/api.py", line 386, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-02_07:12:25
  host      : localhost
  rank      : {other} (local_rank: {other})
  exitcode  : {other_code} (pid: 30076) {other_signal}
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 30076
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_07:12:25
  host      : localhost
  rank      : {root} (local_rank: {root})
  exitcode  : {root_code} (pid: 30075)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""  # torch 2.14's report when a rank failed, as its output has it


WORKER_TRACEBACK = """Traceback (most recent call last):
  File "/work/main/train.py", line 37, in <module>
    main()
RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:51814
"""


def fake_torchrun(tmp_path: Path, stdout: str, stderr: str, status: int, **env: str) -> subprocess.CompletedProcess:
    """launch/common.sh's run_or_print around a stand-in for torchrun that prints what torchrun and its ranks
    printed and exits with torchrun's status: the summary from a known report, in a second."""
    (tmp_path / "out").write_text(stdout)
    (tmp_path / "err").write_text(stderr)
    script = ('set -euo pipefail; source launch/common.sh; '  # as the launch scripts run it
              'run_or_print bash -c \'cat "$OUT"; cat "$ERR" >&2; '
              '[ -z "${ORPHAN:-}" ] || { sleep 300 & echo $! > "$ORPHAN"; }; exit "$STATUS"\'')  # ORPHAN: below
    env = dict(os.environ, OUT=str(tmp_path / "out"), ERR=str(tmp_path / "err"), STATUS=str(status),
               RUN_DIR=str(tmp_path / "default"), RESUME_CMD="launch/train.sh x=1", **env)
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_a_ranks_error_is_the_last_word_before_one_line_naming_that_rank(tmp_path):
    """Rank 0 exits 2 with its error; torchrun stops rank 1 (-15) after its traceback (a broken connection)."""
    error = "error: sample 7 of data/x holds token id 9999, beyond the vocabulary (384)"
    stderr = (f"{error}\n{AGENT}:1028] Sending process 30076 closing signal SIGTERM\n{WORKER_TRACEBACK}"
              f"{AGENT}:1002] failed (exitcode: 2) local_rank: 0 (pid: 30075) of binary: python\n" +
              TORCHRUN_TRACEBACK.format(other=1, other_code=-15, other_signal=" (SIGTERM)", root=0, root_code=2))
    done = fake_torchrun(tmp_path, "", stderr, 1)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-2:] == [
        error, f"error: training failed: rank 0 exited with code 2 (the user's error, above), the first to fail, "
               f"after 0 of MAX_RESTARTS=0 restart(s); run dir {tmp_path}/default; the newest checkpoint: none in "
               f"{tmp_path}/default/checkpoints"]  # no checkpoint: no command to resume
    assert WORKER_TRACEBACK in done.stderr  # a rank's own traceback is shown, torchrun's report is not
    for noise in ("ChildFailedError", "run.py", "closing signal", "failed (exitcode", "-15"):
        assert noise not in done.stderr


def test_a_killed_rank_is_blamed_not_the_peer_torchrun_saw_first(tmp_path):
    """torchrun's "first observed" is rank 0 (exit 1: its peer vanished); rank 1 was SIGKILLed (OOM killer), in the
    second attempt (MAX_RESTARTS=1: torchrun logs its restarts at INFO, which it does not print; rank 0's "run dir:"
    line starts each attempt)."""
    run_dir, checkpoints = tmp_path / "run", tmp_path / "elsewhere"
    checkpoints.mkdir()
    (checkpoints / "latest").write_text("iter_0000004")
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(f"model:\n  dir: x\ncheckpoint:\n  dir: {checkpoints}\n  load: auto\n")
    stderr = WORKER_TRACEBACK + TORCHRUN_TRACEBACK.format(other=1, other_code=-9, other_signal=" (SIGKILL)", root=0,
                                                          root_code=1)
    done = fake_torchrun(tmp_path, f"run dir: {run_dir}\n iter 5\nrun dir: {run_dir}\n iter 5\n", stderr, 1,
                         MAX_RESTARTS="1")
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"error: training failed: rank 1 exited with code -9 (killed by signal 9: kill -9, or the kernel's "
        f"out-of-memory killer, which dmesg names), the first to fail, after 1 of MAX_RESTARTS=1 restart(s); run "
        f"dir {run_dir}; the newest checkpoint: {checkpoints}/iter_0000004; resume with: RUN_DIR={run_dir} "
        f"launch/train.sh x=1")  # the run dir rank 0 reported, the config's checkpoint.dir


SITE = "/venv/lib/python3.12/site-packages/torch/distributed"
STORE_WARNING = """[W1202 14:05:28.860930454 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed on SocketImpl(fd=3, \
addr=[::ffff:127.0.0.1]:48070, remote=[::ffff:127.0.0.1]:58463): Failed to recv, got 0 bytes. Connection was likely \
closed. Did the remote server shutdown or crash?
Exception raised from recvBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp:790 (most recent call \
first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7fa9cf6b460d in /venv/torch/lib/libc10.so)
<omitting python frames>
frame #29: _start + 0x21 (0x55c2ec554081 in /venv/bin/python)

W1202 14:05:28.547000 7165 {site}/elastic/rendezvous/dynamic_rendezvous.py:1298] The node '127.0.0.1_7165_0' has \
failed to shutdown the rendezvous 'run3' due to an error of type RendezvousConnectionError.
"""
LOST_STORE = """Traceback (most recent call last):
  File "{site}/elastic/rendezvous/c10d_rendezvous_backend.py", line {line}, in {function}
    return getattr(self._store, store_op)(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
torch.distributed.DistNetworkError: {cause}

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "{site}/run.py", line 1142, in <module>
    main()
  File "{site}/elastic/rendezvous/c10d_rendezvous_backend.py", line 116, in _call_store
    raise RendezvousConnectionError(
torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store has failed. See \
inner exception for details.
"""  # torch 2.14 on node 1 when node 0's torchrun ended (its store closed) / never started (abridged)


def test_a_node_that_lost_node_0s_rendezvous_says_so_in_one_line(tmp_path):
    """launch/multinode.sh on node 1: node 0's torchrun ended (its ranks failed), or never started within
    RDZV_TIMEOUT (node 0's launch refused): one line each, no torch traceback or c10d warning; exit 1 (node 0's own
    code, under srun the job's, stays the highest), or 2 (where node 1 looked: the user's to fix)."""
    lost = STORE_WARNING.format(site=SITE) + LOST_STORE.format(
        site=SITE, line=114, function="_call_store", cause="Failed to recv, got 0 bytes. Connection was likely closed.")
    env = dict(NODE_RANK="1", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500", RDZV_TIMEOUT="900")
    done = fake_torchrun(tmp_path, "", lost, 1, **env)
    assert (done.returncode, done.stderr.splitlines()) == (1, [
        f"error: training failed: node 0's torchrun ended (the job failed on a node: see {tmp_path}/default/logs/"
        f"node*.log), after 0 of MAX_RESTARTS=0 restart(s); run dir {tmp_path}/default; the newest checkpoint: none "
        f"in {tmp_path}/default/checkpoints"]), done.stderr
    never = LOST_STORE.format(site=SITE, line=156, function="_create_tcp_store", cause="The client socket has timed "
                              "out after 900000ms while trying to connect to (10.0.0.1, 29500).")
    done = fake_torchrun(tmp_path, "", never, 1, **env)
    assert (done.returncode, done.stderr.splitlines()) == (2, [
        "error: node 1 found no rendezvous at 10.0.0.1:29500 within RDZV_TIMEOUT=900 s (torch tries twice): node 0 "
        f"did not start (its output, {tmp_path}/default/logs/node0.log, says why) or MASTER_ADDR:MASTER_PORT is not "
        "node 0's"]), done.stderr
    other = LOST_STORE.format(site=SITE, line=114, function="_call_store", cause="x").replace(
        "RendezvousConnectionError", "RendezvousTimeoutError")  # any other failure of torchrun's: shown whole
    done = fake_torchrun(tmp_path, "", STORE_WARNING.format(site=SITE) + other, 1, **env)
    assert done.returncode == 1 and other in done.stderr and "Connection was likely" in done.stderr, done.stderr


def report(root: int, root_code: int, other: int) -> str:
    return TORCHRUN_TRACEBACK.format(other=other, other_code=-15, other_signal=" (SIGTERM)", root=root,
                                     root_code=root_code)


def test_an_error_of_rank_1_alone_reaches_the_user_one_said_by_every_rank_is_said_once(tmp_path):
    """Under the launcher every rank prints its errors (training/errors.py), the other ranks as `error: rank N:`;
    the filter shows such a line only if no rank said the same without the prefix."""
    alone = "error: rank 1: data.paths: data/x_text_document.bin holds token id 9999, beyond the vocabulary (384)"
    done = fake_torchrun(tmp_path, "", f"{alone}\n{WORKER_TRACEBACK}{report(1, 2, 0)}", 1)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-2:] == [alone, (
        f"error: training failed: rank 1 exited with code 2 (the user's error, above), the first to fail, after 0 of "
        f"MAX_RESTARTS=0 restart(s); run dir {tmp_path}/default; the newest checkpoint: none in "
        f"{tmp_path}/default/checkpoints")]
    same = "checkpoint x is incomplete or not a checkpoint"
    done = fake_torchrun(tmp_path, "", f"error: rank 1: {same}\nerror: {same}\n{report(0, 2, 1)}", 1)
    assert done.returncode == 2 and [line for line in done.stderr.splitlines() if same in line] == [
        f"error: {same}"], done.stderr


def test_an_orphan_holding_the_output_does_not_hold_the_launcher(tmp_path):
    """A killed rank's child process that lives on (tests/test_faults.py kills one) keeps the filters' input
    open: the launch script still ends with its summary, and its output reaches its end (the filters go too)."""
    orphan = tmp_path / "orphan.pid"
    try:
        done = fake_torchrun(tmp_path, "", report(1, -9, 0), 1, ORPHAN=str(orphan))  # a timeout: the bug
    finally:
        if orphan.exists():
            os.kill(int(orphan.read_text()), 9)
    assert done.returncode == 1 and done.stderr.splitlines()[-1].startswith(
        "error: training failed: rank 1 exited with code -9 (killed by signal 9: kill -9, or the kernel's "
        "out-of-memory killer, which dmesg names), the first to fail"), done.stderr


def test_which_rank_prints_an_error(monkeypatch, capsys):
    """Rank 0 prints an error raised on every rank; another rank prints its errors only under the launcher (with
    its rank), or when it raised the error alone (TemplateError(rank=N), whose message names it)."""
    from training.errors import EVERY_RANK, TemplateError, print_error

    def printed(rank: str, err: BaseException, launcher: bool) -> str:
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv(EVERY_RANK, "1" if launcher else "0")
        print_error(err)
        return capsys.readouterr().err

    everywhere, alone = TemplateError("bad\nworse"), TemplateError("saving failed on rank 1", rank=1)
    assert printed("0", everywhere, False) == printed("0", everywhere, True) == "error: bad\nerror: worse\n"
    assert printed("1", everywhere, False) == ""
    assert printed("1", everywhere, True) == "error: rank 1: bad\nerror: rank 1: worse\n"
    assert printed("1", alone, False) == printed("1", alone, True) == "error: saving failed on rank 1\n"


def test_an_error_reaches_the_shared_pipe_in_one_write(monkeypatch):
    """Under the launcher every rank writes to one pipe, unbuffered (PYTHONUNBUFFERED=1): an error written in pieces
    (print's text, then its newline) can have a peer's copy land between them, `error: rank 1: Xerror: X` and an
    empty line, and the filter then shows rank 1's copy as well (CI saw it once). One write per error."""
    import sys

    from training.errors import EVERY_RANK, TemplateError, print_error

    class Recorder:
        def __init__(self):
            self.writes = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv(EVERY_RANK, "1")
    monkeypatch.setattr(sys, "stderr", Recorder())
    print_error(TemplateError("bad\nworse"))
    assert sys.stderr.writes == ["error: rank 1: bad\nerror: rank 1: worse\n"]
