"""model.compile: torch.compile on each transformer layer (training/engine/build.py compile_layers) trains the same
model as eager. From the same initialisation, 10 full steps (the optimizer and the schedule) at tp1 and at tp2: the
loss of every step within 1e-5 (relative) of eager's. Eager and compiled run one after the other in one process
group per tp (tests/layouts.py). Without a C/C++ compiler on PATH the setting is refused in one line."""

import pytest
from harness import run_distributed
from layouts import make_batch, model_overrides, run_layouts

from training.config.compose import compose
from training.config.validate import validate
from training.errors import ConfigError

STEPS = 10
RTOL = 1e-5
TRAIN = ["optim.lr=1e-2", "optim.warmup_iters=0"]  # a loss that moves over 10 steps
BATCH = make_batch(global_batch=4, seq=16)


def _compiled_layers(runs: list[list[str]]) -> list[list[bool]]:
    """On one rank, per config: build as training does; per transformer layer, whether torch.compile wraps it."""
    from models.layer import TransformerLayer
    from models.shape import ModelShape
    from training.engine.build import build
    from training.parallel import dist as D
    from training.parallel.wrap import unwrap

    out = []
    for overrides in runs:
        cfg = compose(overrides)
        with D.distributed(**D.layout_of(cfg)) as info:
            state = build(cfg, ModelShape.of(cfg.model, 101), info.device)
            out.append([m._compiled_call_impl is not None for m in unwrap(state.model[0]).modules()
                        if isinstance(m, TransformerLayer)])
    return out


def test_model_compile_compiles_every_layer_and_only_then():
    compiled, eager = run_distributed(_compiled_layers, 1, ([model_overrides("model.compile=true"),
                                                             model_overrides()],))[0]
    assert compiled == [True] * 4 and eager == [False] * 4


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_compiled_layers_train_like_eager(tp):
    base = model_overrides(*TRAIN, f"parallel.tp={tp}")
    results = run_layouts([(base, None, STEPS, False), (base + ["model.compile=true"], None, STEPS, False)], tp,
                          BATCH, timeout=900.0)
    for result in results:
        if isinstance(result, Exception):
            raise result
    eager, compiled = results
    assert len(compiled["losses"]) == len(eager["losses"]) == STEPS
    assert eager["losses"][-1] < 0.9 * eager["losses"][0]  # it trains: the comparison is not between constants
    diffs = [abs(c - e) / abs(e) for c, e in zip(compiled["losses"], eager["losses"])]
    print(f"tp{tp}: max relative loss difference compiled / eager over {STEPS} steps {max(diffs):.2e}")
    assert max(diffs) <= RTOL, f"losses: compiled {compiled['losses']}, eager {eager['losses']}"


def test_compile_without_a_compiler_is_one_line(monkeypatch, tmp_path):
    """No C/C++ compiler on PATH: refused before any process starts, naming the setting and the fix."""
    cfg = compose(["model.compile=true"])
    validate(cfg)  # this machine has one
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no g++, clang++
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError, match=r"^model.compile=true: .* install g\+\+ .* or set model.compile=false$"):
        validate(cfg)
