"""Checkpoints: bit-exact resume, resharding with the optimizer state, saves that never lose the last
good state, clear errors for corrupt or mismatched checkpoints."""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from chat_fixtures import chat_tokenizer
from harness import run_distributed
from layouts import assemble, global_name
from runs import QUICK, train

ROOT = Path(__file__).resolve().parents[1]
SAVE_AT_10 = ["train.iters=20", "train.save_interval=10", "checkpoint.keep=0"]
LAYOUTS = {  # (TP alone: inside tp2-dp2-distopt)
    "pp2": (["parallel.pp=2"], 2),
    "tp2-dp2-distopt": (["parallel.tp=2", "parallel.dist_opt=true"], 4),
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each layout trained 20 iterations in one go, saving at 10 and 20 (computed once)."""
    cache = {}

    def get(layout: str):
        if layout not in cache:
            run_dir = tmp_path_factory.mktemp(f"full-{layout}")
            extra, world = LAYOUTS[layout]
            cache[layout] = (run_dir, train(SAVE_AT_10 + extra, world, run_dir))
        return cache[layout]

    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_from_iteration_10_is_bit_identical(layout, uninterrupted, tmp_path):
    full_dir, full = uninterrupted(layout)
    extra, world = LAYOUTS[layout]
    resumed = train(SAVE_AT_10 + extra + [f"checkpoint.load={full_dir}/checkpoints/iter_0000010"], world, tmp_path)
    assert sorted(resumed) == list(range(11, 21))
    assert {i: full[i] for i in resumed} == resumed  # exact float equality, every iteration


def test_async_save_trains_the_same_and_resumes_bit_identical(uninterrupted, tmp_path):
    """checkpoint.async_save: the same losses as saving synchronously, complete checkpoints, and a run resumed
    from one continues bit for bit (its model, optimizer, schedule, RNG and data position were written while
    training went on, from the state at the save)."""
    full_dir, full = uninterrupted("pp2")
    extra, world = LAYOUTS["pp2"]
    written = train(SAVE_AT_10 + extra + ["checkpoint.async_save=true"], world, tmp_path / "async")
    assert written == full
    ckpts = tmp_path / "async" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "iter_0000020"
    assert all((ckpts / name / "run.json").is_file() for name in ("iter_0000010", "iter_0000020"))
    resumed = train(SAVE_AT_10 + extra + [f"checkpoint.load={ckpts}/iter_0000010"], world, tmp_path / "resume")
    assert resumed == {i: full[i] for i in range(11, 21)}


def _moments_after_load(overrides: list[str], checkpoint_dir: str) -> dict:
    """Build a layout, load the checkpoint, return each local parameter's Adam moments and shard info
    (distributed optimizer at DP=1: each rank's optimizer shard is its whole, flattened parameter)."""
    from megatron.core import parallel_state as ps

    from models.shape import ModelShape
    from training import checkpoint
    from training.config.compose import compose
    from training.engine.build import build
    from training.parallel import dist as D
    from training.parallel.wrap import unwrap

    cfg = compose(QUICK + overrides + [f"checkpoint.load={checkpoint_dir}", "checkpoint.dir=null"])
    with D.distributed(tp=cfg.parallel.tp, pp=cfg.parallel.pp, timeout_minutes=2) as info:
        state = build(cfg, ModelShape.of(cfg.model, 257), info.device)
        start = checkpoint.maybe_load(cfg, state)
        (opt,) = state.optimizer.chained_optimizers
        out = {"iteration": start.iteration}
        for chunk in state.model:
            gpt = unwrap(chunk)
            for name, param in gpt.named_parameters():
                group, order = opt.model_param_group_index_map[param]
                state = opt.optimizer.state[opt.optimizer.param_groups[group]["params"][order]]
                parallel = getattr(param, "tensor_model_parallel", False)
                shard = (ps.get_tensor_model_parallel_rank(), cfg.parallel.tp,
                         param.partition_dim if parallel else None, param.partition_stride if parallel else 1)
                for key in ("exp_avg", "exp_avg_sq"):
                    out.setdefault(f"{key}.{global_name(gpt, name)}", []).append(
                        (*shard, state[key].view(param.shape).clone()))
        return out


@pytest.mark.parametrize("target", ["tp1", "pp2"])
def test_reshard_distopt_tp2_dp2_keeps_adam_state_and_losses(target, uninterrupted, tmp_path):
    full_dir, full = uninterrupted("tp2-dp2-distopt")
    ckpt = full_dir / "checkpoints" / "iter_0000010"
    # The distributed optimizer's fully_reshardable checkpoint reshards into any TP / PP / DP
    # (at DP=1 too); switching parallel.dist_opt on resume is refused (test below).
    extra, world = {"tp1": (["parallel.dist_opt=true"], 1),
                    "pp2": (["parallel.pp=2", "parallel.dist_opt=true"], 2)}[target]

    # Adam's moments after loading equal the originals (the checkpoint's full, gathered tensors).
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt), str(tmp_path / "original.pt"))
    original = torch.load(tmp_path / "original.pt", weights_only=False)
    parts: dict[str, list] = {}
    for result in run_distributed(_moments_after_load, world, (extra, str(ckpt)), timeout=300):
        assert result.pop("iteration") == 10
        for key, pieces in result.items():
            parts.setdefault(key, []).extend(pieces)
    saved_moments = {k.removeprefix("optimizer.state.") for k in original
                     if k.startswith(("optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq."))}
    assert set(parts) == saved_moments  # exp_avg and exp_avg_sq of every parameter, nothing else
    for key, pieces in parts.items():
        loaded = assemble(pieces, None)
        saved = original[f"optimizer.state.{key}"][: loaded.shape[0]]  # vocab padding: tp2 pads more
        assert torch.equal(loaded, saved), key

    # Training continues as the uninterrupted tp2 x dp2 run did (reduction order differs: 1e-5).
    resumed = train(SAVE_AT_10 + extra + [f"checkpoint.load={ckpt}"], world, tmp_path / "run")
    assert sorted(resumed) == list(range(11, 21))
    for i, loss in resumed.items():
        assert loss == pytest.approx(full[i], rel=1e-5), (i, loss, full[i])


def _launch(tmp_path: Path, *overrides: str, nproc: int = 2, **extra_env: str) -> subprocess.Popen:
    env = dict(os.environ, NPROC=str(nproc), RUN_DIR=str(tmp_path / "run"), **extra_env)
    return subprocess.Popen(["launch/train.sh", *QUICK, *overrides], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _workers(launcher: subprocess.Popen) -> list[int]:
    """PIDs of the training processes (train.py under torchrun) started by a launch."""
    import psutil

    return [p.pid for p in psutil.Process(launcher.pid).children(recursive=True)
            if "train.py" in p.cmdline() and "torch.distributed.run" not in p.cmdline()]


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_sigkill_during_a_save_leaves_latest_loadable(tmp_path):
    hook = ROOT / "tests" / "fixtures" / "save_hang"  # its sitecustomize.py holds rank 1 inside its second save
    marker, ckpts = tmp_path / "rank1_in_save", tmp_path / "run" / "checkpoints"
    pythonpath = os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    launcher = _launch(tmp_path, "train.iters=100000", "train.save_interval=1", "checkpoint.keep=2",
                       PYTHONPATH=pythonpath, SAVE_HANG_MARKER=str(marker))
    try:
        _wait_for(marker.exists, 300, "rank 1 inside its second save")
        pid, partial = marker.read_text().split(" ", 1)
        assert int(pid) in _workers(launcher)
        partial = Path(partial)
        # the save has started and not finished: shards on disk, no completion marker, latest the save before
        assert partial == ckpts / "iter_0000002" and any(partial.glob("*.distcp")), list(partial.iterdir())
        assert not (partial / "run.json").exists()
        assert (ckpts / "latest").read_text().strip() == "iter_0000001"
        os.kill(int(pid), signal.SIGKILL)  # one rank dies mid-save
        launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:  # a failed check above: torchrun and the workers must not train on
            import psutil

            for process in [*psutil.Process(launcher.pid).children(recursive=True), psutil.Process(launcher.pid)]:
                process.kill()
    assert launcher.returncode != 0
    assert partial.is_dir() and not (partial / "run.json").exists(), "the interrupted save must never complete"
    latest = ckpts / (ckpts / "latest").read_text().strip()
    assert latest == ckpts / "iter_0000001" and (latest / "run.json").exists(), "latest must name a complete checkpoint"

    # ... and it loads: a resumed run (auto) starts right after it.
    iteration = json.loads((latest / "run.json").read_text())["iteration"]
    resumed = train([f"checkpoint.dir={ckpts}", f"train.iters={iteration + 1}"], 2, tmp_path / "resume")
    assert list(resumed) == [iteration + 1]


def _load_each(override_sets: list[list[str]], save_weights_to: str | None = None) -> list[str]:
    """In one process: optionally save a bare model's weights (what conversions write), then for each
    override set build the model and load per its checkpoint settings; 'loaded iteration N' or the error."""
    from models.shape import ModelShape
    from training import checkpoint
    from training.config.compose import compose
    from training.engine.build import build
    from training.errors import TemplateError
    from training.parallel import dist as D

    results = []
    with D.distributed(timeout_minutes=2) as info:
        if save_weights_to is not None:
            cfg = compose(QUICK + [f"checkpoint.dir={save_weights_to}"])
            checkpoint.save(cfg, build(cfg, ModelShape.of(cfg.model, 257), info.device, train=False), iteration=0,
                            consumed_samples=0, model_only=True)
        for overrides in override_sets:
            cfg = compose(QUICK + overrides)
            state = build(cfg, ModelShape.of(cfg.model, 257), info.device)
            try:
                results.append(f"loaded iteration {checkpoint.maybe_load(cfg, state).iteration}")
            except TemplateError as err:
                results.append(f"error: {err}")
    return results


def test_partial_corrupt_and_mismatched_checkpoints(tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    train(["train.iters=4", "train.save_interval=2", "checkpoint.keep=0"], 1, tmp_path / "run")
    assert sorted(p.name for p in ckpts.glob("iter_*")) == ["iter_0000002", "iter_0000004"]

    # A save that died before finishing: auto skips it and takes the newest complete one; loading it
    # explicitly names it.
    (ckpts / "iter_0000006").mkdir()
    (ckpts / "iter_0000006" / "__0_0.distcp").write_bytes(b"partial")
    shutil.copytree(ckpts / "iter_0000002", ckpts / "iter_0000003")  # its run.json cut short below
    run_json = ckpts / "iter_0000003" / "run.json"
    run_json.write_text(run_json.read_text()[:40])
    (results,) = run_distributed(_load_each, 1, ([[f"checkpoint.dir={ckpts}", "checkpoint.load=auto"],
                                                  [f"checkpoint.load={ckpts}/iter_0000006"],
                                                  [f"checkpoint.load={ckpts}/iter_0000003"],
                                                  [f"checkpoint.load={ckpts.parent}"]],), timeout=180)  # the run dir
    assert results[0] == "loaded iteration 4"
    assert results[1].startswith("error: checkpoint") and "iter_0000006 is incomplete" in results[1]
    assert results[1].endswith(f"; the newest complete one: {ckpts}/iter_0000004"), results[1]
    assert results[3] == f"error: checkpoint {ckpts.parent} is a run dir, not a checkpoint: give {ckpts}"
    assert results[2].startswith(f"error: cannot load checkpoint {ckpts}/iter_0000003: run.json: JSONDecodeError: ")
    assert results[2].endswith(f"; an earlier complete checkpoint: {ckpts}/iter_0000002"), results[2]
    shutil.rmtree(ckpts / "iter_0000003")

    tokenizer = chat_tokenizer(tmp_path / "tokenizer")  # 256 bytes and a few special tokens: not `byte`
    shard = next((ckpts / "iter_0000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-64] + b"\0" * 64)
    (results,) = run_distributed(_load_each, 1, ([
        [f"checkpoint.load={ckpts}/iter_0000004"],  # a corrupted shard
        [f"checkpoint.load={ckpts}/iter_0000002", "model.hidden_size=64", "model.ffn_hidden_size=176"],
        [f"checkpoint.load={ckpts}/iter_0000002", "parallel.dist_opt=true"],  # another optimizer type
        [f"checkpoint.load={ckpts}/iter_0000002", f"data.tokenizer={tokenizer}", "checkpoint.finetune=true"],
    ],), timeout=180)
    assert results[0].startswith(f"error: cannot load checkpoint {ckpts}/iter_0000004")  # the integrity check
    assert shard.name in results[0], results[0]  # the file that failed (its message's second line)
    assert results[0].endswith(f"; an earlier complete checkpoint: {ckpts}/iter_0000002"), results[0]
    assert "hidden_size: checkpoint 128 vs config 64" in results[1]  # every differing field is named
    assert "ffn_hidden_size: checkpoint 352 vs config 176" in results[1]
    assert "saved with parallel.dist_opt=false but this run has parallel.dist_opt=true" in results[2]
    assert results[3] == (f"error: checkpoint {ckpts}/iter_0000002 was written with the tokenizer byte, this run has "
                          f"data.tokenizer={tokenizer}: its token ids stand for other text. Set data.tokenizer=byte "
                          f"(and preprocess the data with it)")


def test_keep_prunes_old_checkpoints_and_latest_is_atomic(tmp_path):
    train(["train.iters=6", "train.save_interval=2", "checkpoint.keep=2"], 1, tmp_path)
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("iter_*")) == ["iter_0000004", "iter_0000006"]
    assert (ckpts / "latest").read_text() == "iter_0000006\n"
    assert not list(ckpts.glob(".latest.tmp*"))
    run = json.loads((ckpts / "iter_0000006" / "run.json").read_text())
    assert run["iteration"] == 6 and run["consumed_samples"] == 6 * 8
    assert run["versions"]["megatron-core"] == "0.19.2" and run["versions"]["torch"] == torch.__version__
    assert run["config"]["model"]["num_layers"] == 2 and run["layout"] == {"tp": 1, "pp": 1, "dp": 1, "cp": 1}


def test_save_interval_minutes_saves_on_the_clock(tmp_path):
    # a clock interval shorter than a step: every iteration is due although save_interval is off
    train(["train.iters=3", "train.save_interval=0", "train.save_interval_minutes=1e-6", "checkpoint.keep=0"], 1,
          tmp_path)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("iter_*"))
    assert names == ["iter_0000001", "iter_0000002", "iter_0000003"]


def test_weights_only_checkpoint_loads_only_as_a_finetune(tmp_path):
    weights = tmp_path / "weights"
    (refused, loaded), = run_distributed(_load_each, 1, ([[f"checkpoint.load={weights}"],
                                                          [f"checkpoint.load={weights}", "checkpoint.finetune=true"]],
                                                         str(weights)), timeout=180)
    assert json.loads((weights / "iter_0000000" / "run.json").read_text())["weights_only"] is True
    assert "holds weights only" in refused and "checkpoint.finetune=true" in refused
    assert loaded == "loaded iteration 0"
