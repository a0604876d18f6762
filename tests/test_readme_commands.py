"""The README's commands run as written on a fresh clone after its set-up command, from a shell whose `python` is
not the project's venv (a user who never activated it): every doc calls the venv's interpreter by its path, and
each command of the README's command blocks runs (a dry run, or `--help` where the real one trains or needs the
user's files) with no traceback and a documented result."""

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "tools").glob("*.py"))]
VENV_PYTHON = ".venv/bin/python"
RUN_AS_WRITTEN = {"tools/plan.py"}  # quick and self-contained: run whole; the other tools show their --help
NOT_HERE = {"sbatch", "kubectl"}  # need a scheduler or a cluster: tests/test_launch.py runs their scripts' parts


def commands(markdown: str) -> list[str]:
    """Each command of the ```bash blocks, continuation lines joined, comment lines dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                out.append(line.strip())
    return out


def shell_without_venv() -> dict[str, str]:
    """The environment of a shell that never activated .venv: its bin/ off PATH, no VIRTUAL_ENV."""
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if Path(p) != ROOT / ".venv" / "bin"]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "MASTER_PORT")}
    return dict(env, PATH=os.pathsep.join(path))


def as_check(command: str) -> tuple[list[str], dict[str, str]] | None:
    """The command to run for a README command: launch scripts with DRY_RUN=1, tools with --help unless they are
    quick and self-contained, `make` targets with -n; None for what needs a scheduler or cluster."""
    words = shlex.split(command.split("|")[0], comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if not words or words[0] in NOT_HERE:
        return None
    if words[0] == "make":
        return ["make", "-n", *words[1:]], env
    if words[0].startswith("launch/"):
        return words, dict(env, DRY_RUN="1")
    assert words[:2][0] == VENV_PYTHON and words[1].startswith("tools/"), command
    return (words if words[1] in RUN_AS_WRITTEN else words[:2] + ["--help"]), env


@pytest.mark.fast
def test_every_doc_command_calls_the_venvs_python():
    """A bare `python tools/...` runs whatever `python` the shell has (3.11 here: a SyntaxError in plan.py; or
    `No module named 'training'`): every doc and tool docstring says `.venv/bin/python`."""
    bare = re.compile(r"(?<![\w/.])python3?(?:\.\d+)? (?:-m (?!venv)|tools/)")
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in DOCS
             for n, line in enumerate(path.read_text().splitlines(), 1) if bare.search(line)]
    assert not found, "\n".join(found)


def test_the_readmes_command_blocks_run_as_written_without_the_venv_on_path(tmp_path):
    readme = commands((ROOT / "README.md").read_text())
    assert any("tools/plan.py" in c for c in readme) and any(c.startswith("make train") for c in readme)
    env = shell_without_venv()
    ran = 0
    for command in readme:
        if (check := as_check(command)) is None:
            continue
        argv, extra = check
        proc = subprocess.run(argv, cwd=ROOT, env=dict(env, **extra), capture_output=True, text=True, timeout=300)
        output = proc.stdout + proc.stderr
        assert "Traceback" not in output, f"{command}\n{output[-3000:]}"
        last = output.strip().splitlines()[-1] if output.strip() else ""
        # a command that names the user's own files (an import, a corpus) says in one line what is missing
        assert proc.returncode == 0 or (proc.returncode == 2 and last.startswith("error: ")), f"{command}\n{output}"
        ran += 1
    assert ran >= 15, ran
