"""The README's and docs/'s commands run as written on a fresh clone after its set-up command, from a shell whose
`python` is not the project's venv (a user who never activated it): every doc calls the venv's interpreter by its
path, and each command of their command blocks runs (a dry run, or `--help` where the real one trains or needs the
user's files) with no traceback and exit 0, or exit 2 whose every `error:` line names a file of the command that
the user has to bring (a checkpoint, a corpus, a tokenizer): a config error (an lr below min_lr) fails the test.
A `model=local/NAME` preset, which `tools/convert_hf.py import` writes, is stood in for by the family's preset."""

import os
import re
import shlex
import subprocess
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "tools").glob("*.py"))]
VENV_PYTHON = ".venv/bin/python"
RUN_AS_WRITTEN = {"tools/plan.py"}  # quick and self-contained: run whole; the other tools show their --help
NOT_HERE = {"sbatch", "kubectl", "torchrun", "pip", "wandb", "python"}  # a scheduler, a cluster, the network, a GPU
# node or the user's own interpreter: tests/test_launch.py runs the scripts' parts; `python -c` loads the user's export
LOCAL_PRESETS = {"llama32": "llama3_2_1b", "llama32_1b": "llama3_2_1b", "llama_hf": "llama3_2_1b",
                 "my_llama": "llama3_2_1b", "qwen3moe": "qwen3_30b_a3b"}  # what the docs' imports would write


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
    words = [os.path.expanduser(os.path.expandvars(w)) for w in shlex.split(command.split("|")[0], comments=True)]
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
    if words[:2] == [VENV_PYTHON, "train.py"]:  # a run in this process: the checks train.py's launch would make
        return [VENV_PYTHON, "tools/check_config.py", *words[2:]], env
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


def missing_files(command: str) -> set[str]:
    """The paths a command names (an argument, a key=value's value, a list's items) that do not exist here, and the
    user's own modules (`model.mlp=my_package.my_mlp:MyMLP`) that are not importable here."""
    found = set()
    for word in shlex.split(os.path.expanduser(os.path.expandvars(command.split("|")[0])), comments=True):
        value = word.split("=", 1)[-1].strip("[]'\"")
        for item in value.split(","):
            if "/" in item and not item.startswith("-") and not (ROOT / item).exists() and not Path(item).exists():
                found.add(item)
            if re.fullmatch(r"[A-Za-z_][\w.]*:\w+", item) and find_spec(item.split(".")[0].split(":")[0]) is None:
                found.add(item)
    return found


@pytest.fixture(scope="module")
def local_presets():
    """conf/model/local/NAME.yaml (git-ignored, an import's output) for the docs' NAMEs the user has not got."""
    local = ROOT / "conf" / "model" / "local"
    made = [local / f"{name}.yaml" for name in LOCAL_PRESETS if not (local / f"{name}.yaml").exists()]
    local.mkdir(exist_ok=True)
    for path in made:
        path.write_text((ROOT / "conf" / "model" / f"{LOCAL_PRESETS[path.stem]}.yaml").read_text())
    yield
    for path in made:
        path.unlink()
    if not any(local.iterdir()):
        local.rmdir()


_RAN: dict[tuple, subprocess.CompletedProcess] = {}


def run_as_written(command: str, env: dict[str, str]) -> bool:
    """Run a doc command's check (as_check); False when there is none to run here."""
    if (check := as_check(command)) is None:
        return False
    argv, extra = check
    key = (tuple(argv), tuple(sorted(extra.items())))
    if key not in _RAN:  # the tools' --help once each, not once per doc command
        _RAN[key] = subprocess.run(argv, cwd=ROOT, env=dict(env, **extra), capture_output=True, text=True, timeout=300)
    proc = _RAN[key]
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output, f"{command}\n{output[-3000:]}"
    last = output.strip().splitlines()[-1] if output.strip() else ""
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    missing = missing_files(command)
    # a command that names the user's own files (an import, a corpus) says in one line what is missing, and only that
    assert proc.returncode == 0 or (proc.returncode == 2 and last.startswith("error: ") and all(
        any(path in line for path in missing) for line in errors)), f"{command}\nmissing here: {missing}\n{output}"
    return True


def test_the_readmes_command_blocks_run_as_written_without_the_venv_on_path(local_presets):
    readme = commands((ROOT / "README.md").read_text())
    assert any("tools/plan.py" in c for c in readme) and any(c.startswith("make train") for c in readme)
    env = shell_without_venv()
    ran = sum(run_as_written(command, env) for command in readme)
    assert ran >= 15, ran


def test_every_docs_command_runs_as_written(local_presets):
    """docs/*.md's command blocks (docs/sft.md's fine-tune among them) as the README's."""
    env = shell_without_venv()
    ran = {path.name: sum(run_as_written(command, env) for command in commands(path.read_text()))
           for path in sorted((ROOT / "docs").glob("*.md"))}
    assert ran["sft.md"] >= 5 and ran["hf.md"] >= 20 and sum(ran.values()) >= 80, ran
