"""training/estimate/preflight.py: the estimate reported before the model is built (and refused on a GPU when it
cannot fit), the environment report, and on CPU a warning when the node's processes exceed its memory."""

from __future__ import annotations

import json

import pytest
import torch

from models.shape import ModelShape
from training.config.compose import compose


def test_preflight_reports_on_cpu_and_stops_what_cannot_fit(tmp_path, capsys):
    from training.config.validate import validate
    from training.errors import ConfigError
    from training.estimate.preflight import check, preflight

    cfg = compose(["model=tiny"])
    est = preflight(cfg, validate(cfg, 1), ModelShape.of(cfg.model, 257), torch.device("cpu"), tmp_path)
    assert "CPU: reported, not enforced" in capsys.readouterr().out
    report = json.loads((tmp_path / "environment.json").read_text())
    assert report["packages"]["megatron-core"] == "0.19.2" and report["packages"]["torch"] == torch.__version__
    assert report["memory_estimate"]["gb"] == est.mem_gb()
    check(est, capacity_bytes=int(est.total) + 1, fraction=1.0, model="tiny")  # fits: no error
    with pytest.raises(ConfigError, match=r"exceeds .* train.max_memory_fraction=0.5 .*tools/plan.py model=tiny"):
        check(est, capacity_bytes=int(est.total) + 1, fraction=0.5, model="tiny")


def test_preflight_warns_on_cpu_when_the_nodes_processes_exceed_its_memory(tmp_path, capsys, monkeypatch):
    """The helper's seq_length=100000 run: 2 x 17 GB on a 23 GB machine ended as a bare signal 9."""
    from training.config.validate import validate
    from training.estimate import preflight as P

    cfg = compose(["model=tiny"])
    est = P.preflight(cfg, validate(cfg, 1), ModelShape.of(cfg.model, 257), torch.device("cpu"), tmp_path)
    assert "preflight warning" not in capsys.readouterr().out  # 1 process of the tiny model fits any machine
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(P, "_host_memory", lambda: 1.5 * est.total)
    P.preflight(cfg, validate(cfg, 1), ModelShape.of(cfg.model, 257), torch.device("cpu"), tmp_path)
    out = capsys.readouterr().out
    assert f"preflight warning: by the estimate this node's 2 process(es) need {2 * est.total / 1e9:.1f} GB" in out
    assert "the kernel may kill a rank (signal 9)" in out, out
