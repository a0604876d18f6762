"""The planner's arithmetic against numbers worked out by hand, its command line, and the estimate of
weights + grads + optimizer state against the bytes the real tiny model holds after one step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import run_distributed

from models.gpt import num_params
from models.shape import ModelShape
from training.config.compose import compose
from training.estimate.memory import estimate, layer_activations
from training.parallel.layout import Layout

ROOT = Path(__file__).resolve().parents[1]



def _lay(tp=1, pp=1, vpp=None, cp=1, dp=1, sp=False, dist_opt=False, microbatches=1) -> Layout:
    """A layout of tp x pp x cp x dp ranks whose step has `microbatches` micro-batches of one sequence."""
    return Layout(tp * pp * cp * dp, tp, pp, vpp, cp, sp=sp, dist_opt=dist_opt, micro_batch_size=1,
                  global_batch_size=microbatches * dp)

def load_plan_module():
    spec = importlib.util.spec_from_file_location("plan_tool", ROOT / "tools/plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpt2_124m_matches_korthikanti_by_hand():
    """GPT-2 small with dropout and materialised attention scores: exactly the paper's setting."""
    cfg = compose(["model=gpt2_124m", "train.precision=bf16", "train.micro_batch_size=4",
                   "model.hidden_dropout=0.1", "model.attention_dropout=0.1"])
    # Per layer: qkv 768*2304 + 2304 = 1,771,776; proj 768*768 + 768 = 590,592;
    # fc1 768*3072 + 3072 = 2,362,368; fc2 3072*768 + 768 = 2,360,064; 2 LayerNorms 2*(768+768) = 3,072
    layer = 1_771_776 + 590_592 + 2_362_368 + 2_360_064 + 3_072  # = 7,087,872
    # 12 layers + embedding 50304 (50257 padded to 128) * 768 + positions 1024*768 + final LayerNorm 1536;
    # the output layer is tied: no extra weight on a single stage
    params = 12 * layer + 50_304 * 768 + 1_024 * 768 + 1_536
    assert params == 124_475_904
    dp4 = _lay(dp=4)
    shape = ModelShape.of(cfg.model, 50_257)
    est = estimate(cfg, shape, dp4, flash_attention=False)
    assert est.params_total == est.params_per_gpu == params
    assert est.weights_and_optimizer == 18 * params == 2_240_566_272  # 2 + 4 + 4 + 4 + 4 bytes
    with_dist_opt = estimate(cfg, shape, _lay(dp=4, dist_opt=True), flash_attention=False)
    assert with_dist_opt.weights_and_optimizer == (6 + 12 / 4) * params == 1_120_283_136

    # Korthikanti Table 2, s=1024 b=4 h=768 a=12: sbh(34 + 5as/h) = 3,145,728 * (34 + 80) per layer
    sbh = 1_024 * 4 * 768
    assert layer_activations(cfg, shape, dp4, flash_attention=False) == sbh * (34 + 5 * 12 * 1_024 / 768) == 358_612_992
    tp2 = _lay(tp=2, dp=2)  # TP without SP: sbh(10 + 24/t + 5as/(ht))
    assert layer_activations(cfg, shape, tp2, False) == sbh * (10 + 24 / 2 + 5 * 12 * 1_024 / (768 * 2))
    tp2_sp = _lay(tp=2, dp=2, sp=True)  # selective: sbh * 34 / t
    assert layer_activations(cfg, shape, tp2_sp, False, recompute="selective") == sbh * 34 / 2
    assert layer_activations(cfg, shape, dp4, False, recompute="full") == 2 * sbh  # input only
    # the step's peak: 12 layers, + the final norm and output-layer inputs (2 * 2sbh), + cross-entropy's fp32
    # softmax (4 * s * b * V, as Megatron-LM's theoretical memory counts it; the bf16 logits are not kept)
    assert est.activations == 12 * 358_612_992 + 4 * sbh + 4 * 1_024 * 4 * 50_304 == 5_140_119_552


def test_llama2_7b_tp2_pp2_by_hand():
    """Llama 2 7B (SwiGLU, RMSNorm, RoPE, no biases, untied) at tp=2 pp=2 dp=2 with SP and dist_opt."""
    cfg = compose(["model=llama2_7b", "train.precision=bf16", "train.micro_batch_size=1",
                   "train.global_batch_size=8"])
    # per layer: qkv 4096*3*4096 = 50,331,648; proj 16,777,216; fc1 4096*2*11008 = 90,177,536 (gate|up);
    # fc2 11008*4096 = 45,088,768; 2 RMSNorms 8,192
    split = 50_331_648 + 16_777_216 + 90_177_536 + 45_088_768
    assert 32 * (split + 8_192) + 2 * 32_000 * 4_096 + 4_096 == 6_738_415_616  # Llama 2 7B's published count
    per_rank_layer = split // 2 + 8_192  # TP halves the linear weights; norms are replicated
    first = 16 * per_rank_layer + 32_000 * 4_096 // 2  # 16 layers + half the embedding
    shape = ModelShape.of(cfg.model, 32_000)
    assert num_params(shape, tp=2, pp=2, stage=0) == first == 1_684_668_416
    # last stage: the same layers, the final norm (4,096) and an output layer the size of the embedding
    assert num_params(shape, tp=2, pp=2, stage=1) == first + 4_096
    lay = _lay(tp=2, pp=2, dp=2, sp=True, dist_opt=True, microbatches=4)  # m = 8 / (1 * 2)
    est = estimate(cfg, shape, lay)
    assert est.stage == 0
    assert est.weights_and_optimizer == (6 + 12 / 2) * first == 20_216_020_992
    assert estimate(cfg, shape, _lay(tp=2, pp=2, dp=2, sp=True, microbatches=4)).weights_and_optimizer == 18 * first

    # one layer, s=4096 b=1 h=4096, bf16, tp=2 with SP, flash attention (no s x s scores), in bytes:
    #   norm + linear inputs, sequence-sharded: 2 * 4 * sbh / 2          = 67,108,864
    #   Q, K, V and attention output, TP-sharded: 2 * s*b*(2*4096 + 2*4096) / 2 = 67,108,864
    #   RoPE's rotated Q and K:                   2 * s*b*(4096 + 4096) / 2     = 33,554,432
    #   SwiGLU: fc1 out (2f), SiLU(gate), product: 2 * s*b*4*11008 / 2        = 180,355,072
    per_layer = 67_108_864 + 67_108_864 + 33_554_432 + 180_355_072
    assert layer_activations(cfg, shape, lay, flash_attention=True) == per_layer == 348_127_232
    # 1F1B: stage 0 holds pp = 2 micro-batches of its 16 layers
    assert est.activations == 2 * 16 * per_layer == 11_140_071_424
    assert est.mem_gb() == {"weights_and_optimizer": 20.216, "activations": 11.14, "total": 31.356}
    # interleaved (vpp=2): (1 + (pp-1)/(pp*vpp)) = 1.25 times the 32 layer-micro-batches
    vpp2 = estimate(cfg, shape, _lay(tp=2, pp=2, vpp=2, dp=2, sp=True, dist_opt=True, microbatches=4))
    assert vpp2.activations == 32 * 1.25 * per_layer
    # context parallel 2 at dp 1 (s = 2048 on each rank): every sequence-long tensor halves, but attention keeps
    # Q (rotated), its output and the K and V it gathers at full length (not the local QKV output or rotated K:
    # tests/test_activation_bytes.py), 2 bytes * 2048 * (4096 + 4096 + 2 * 2 * 4096) / tp 2 = 50,331,648 (with
    # MHA as much as without CP); the stage keeps one [s/2, s] bf16 additive mask, shared by the layers; the
    # distributed optimizer shards over dp x cp = 2
    cp2 = _lay(tp=2, pp=2, cp=2, sp=True, dist_opt=True, microbatches=8)  # m = 8 / (1 * 1)
    inputs, swiglu = 67_108_864 / 2, 180_355_072 / 2
    assert layer_activations(cfg, shape, cp2, True) == inputs + 50_331_648 + swiglu == per_layer / 2 == 174_063_616
    est_cp2 = estimate(cfg, shape, cp2)
    assert est_cp2.stage == 0 and est_cp2.weights_and_optimizer == (6 + 12 / 2) * first
    assert est_cp2.activations == 2 * 16 * 174_063_616 + 2 * 2_048 * 4_096


def test_plan_cli_json_lists_layouts_and_recommends_one_that_fits():
    cmd = [sys.executable, str(ROOT / "tools/plan.py"), "--json", "model=llama2_7b", "train.precision=fp32",
           "plan.gpus_per_node=8", "plan.nodes=1", "plan.gpu_mem_gb=80"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert isinstance(rows, list) and rows
    for row in rows:
        assert {"tp", "pp", "vpp", "dp", "sp", "dist_opt", "recompute", "fits", "mem_gb"} <= row.keys()
        assert row["tp"] * row["pp"] * row["cp"] * row["dp"] == 8
        mem = row["mem_gb"]
        assert abs(mem["weights_and_optimizer"] + mem["activations"] - mem["total"]) < 2e-3
    assert any(row["fits"] for row in rows)
    assert rows[0]["fits"] and rows[0]["recommended"] and sum(row["recommended"] for row in rows) == 1
    assert {row["recompute"] for row in rows} == {"none", "selective", "full"}
    # Megatron-FSDP rows (fp32); at tp 2 dp 4 per parameter: ZeRO-1 8 + 8/4 = 10 bytes, ZeRO-2 4 + 16/4 = 8,
    # ZeRO-3 (4 + 16)/4 = 5, plus 4 for each weight outside the FSDP units (gathered): the embedding and the
    # untied output layer (32000 x 4096 each, vocab-parallel over tp 2) and the final norm (4096)
    dp4 = {row["fsdp"]: row["mem_gb"]["weights_and_optimizer"] for row in rows if (row["tp"], row["dp"]) == (2, 4)
           and row["dist_opt"] and row["recompute"] == "none" and not row["sp"] and len(row["tp_blocks"]) == 3}
    assert dp4["optim_grads"] < dp4["none"] and dp4["optim_grads_params"] < dp4["none"], dp4
    params, root = dp4["none"] * 1e9 / 10, 2 * 32000 * 4096 / 2 + 4096
    assert dp4["optim_grads_params"] == pytest.approx((5 * params + 4 * root) / 1e9, rel=1e-3)
    assert dp4["optim_grads"] == pytest.approx(dp4["none"] * 8 / 10, rel=1e-3)


def test_plan_settings_are_checked():
    plan = load_plan_module()
    settings, overrides, as_json = plan.parse_args(["plan.nodes=2", "model=tiny", "--json"])
    assert settings["nodes"] == 2 and overrides == ["model=tiny"] and as_json
    with pytest.raises(ValueError, match="unknown setting plan.gpus"):
        plan.parse_args(["plan.gpus=8"])
    with pytest.raises(ValueError, match="plan.gpu_mem_gb=big is not a number"):
        plan.parse_args(["plan.gpu_mem_gb=big"])


def test_plan_cli_help_and_unknown_option():
    """--help names the options, the overrides and the plan.* settings (exit 0); an unknown --flag is one line, 2."""
    cmd = [sys.executable, str(ROOT / "tools/plan.py")]
    done = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.startswith("usage: tools/plan.py"), done.stderr
    assert all(word in done.stdout for word in ("--json", "Hydra overrides", "plan.gpus_per_node")), done.stdout
    done = subprocess.run([*cmd, "--bogus", "model=tiny"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown option --bogus: "), lines


def _multinode_needs() -> set[str]:
    """What launch/multinode.sh needs set: the variables its header's per-node commands (`#   node 0:  A=1 ...
    launch/multinode.sh`) set and those it stops without (`die "set X=<...>`)."""
    text = (ROOT / "launch/multinode.sh").read_text()
    nodes = [line.split("launch/multinode.sh")[0] for line in text.splitlines() if re.match(r"#\s+node \d+:", line)]
    return {name for line in nodes for name in re.findall(r"\b([A-Z_]+)=", line)} | \
        set(re.findall(r'die "set ([A-Z_]+)=', text))


def _recommended(capsys, nodes: int) -> str:
    plan = load_plan_module()
    assert plan.run(["model=tiny", f"plan.nodes={nodes}", "plan.gpus_per_node=2", "optim.lr=3e-4"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("recommended (#1): ")]
    return line.removeprefix("recommended (#1): ")


def test_plan_multinode_command_sets_what_multinode_sh_needs(capsys):
    """The recommended multi-node command sets every variable launch/multinode.sh needs, each node's and the
    run's own as named <...> placeholders; one node: launch/train.sh."""
    needs = _multinode_needs()
    assert "NNODES" in needs and len(needs) > 1, needs  # the parse found the header's per-node commands
    words = shlex.split(_recommended(capsys, 2))
    env = dict(w.split("=", 1) for w in words[:words.index("launch/multinode.sh")])
    assert needs <= env.keys() and env["NNODES"] == "2" and env["NPROC"] == "2", (needs, words)
    assert env["NODE_RANK"] == "<0..1>" and all(env[k].startswith("<") for k in needs - {"NNODES", "NPROC"}), env
    assert "model=tiny" in words and "optim.lr=3e-4" in words
    one = shlex.split(_recommended(capsys, 1))
    assert one[:2] == ["NPROC=2", "launch/train.sh"] and "model=tiny" in one, one


def test_plan_multinode_command_runs_once_placeholders_are_filled(capsys):
    """The printed command with its placeholders filled in, as a shell runs it (DRY_RUN=1: prints torchrun's)."""
    line = _recommended(capsys, 2)
    line = re.sub(r"<[^>]*>", "localhost", re.sub(r"<0\.\.\d+>", "0", line))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in ("RUN_ID", "RUN_DIR")}
    done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env={**env, "DRY_RUN": "1", "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "--nnodes 2 --nproc-per-node 2" in done.stdout and "--rdzv-id localhost" in done.stdout, done.stdout


def _state_bytes(overrides: list[str], vocab_size: int) -> list[int]:
    """Bytes of params, DDP grad buffers and optimizer state (main params, exp_avg, exp_avg_sq) after one
    optimizer step, each storage counted once (training/bench/measure.py); first without, then with the
    distributed optimizer."""
    from training.bench.measure import state_bytes
    from training.config.validate import validate
    from training.data.streams import MicroBatches
    from training.engine.build import build
    from training.engine.step import train_step
    from training.parallel import dist as D

    out = []
    with D.distributed(tp=1, pp=1, seed=1, timeout_minutes=2) as info:
        for dist_opt in (False, True):
            cfg = compose([*overrides, f"parallel.dist_opt={str(dist_opt).lower()}"])
            derived = validate(cfg)
            state = build(cfg, ModelShape.of(cfg.model, vocab_size), info.device)
            text = torch.randint(0, vocab_size, (4, cfg.model.seq_length + 1),
                                 generator=torch.Generator().manual_seed(0))
            batch = [{"tokens": r[:-1], "labels": r[1:], "loss_mask": torch.ones(cfg.model.seq_length)} for r in text]
            train_step(state, MicroBatches(batch, 0, cfg.train.micro_batch_size, 1, 0), derived, cfg, info.device)
            out.append(state_bytes(state))
            del state
    return out


def test_measured_weights_grads_optimizer_match_the_estimate():
    overrides = ["model=tiny", "train.precision=bf16", "train.micro_batch_size=2", "train.global_batch_size=4",
                 "checkpoint=none", "train.tensorboard=false"]
    vocab_size = 257  # the byte tokenizer's, what the tiny model trains with
    measured = run_distributed(_state_bytes, 1, (overrides, vocab_size), timeout=240)[0]
    for dist_opt, got in zip((False, True), measured):
        lay = _lay(dist_opt=dist_opt, microbatches=2)
        cfg = compose(overrides)
        expected = estimate(cfg, ModelShape.of(cfg.model, vocab_size), lay).weights_and_optimizer
        assert abs(got - expected) / expected < 0.02, (dist_opt, got, expected)


def test_plan_lists_expert_parallel_layouts_for_mixtral():
    """tools/plan.py model=mixtral_8x7b: EP layouts with their memory per GPU, and the architecture's count."""
    cmd = [sys.executable, str(ROOT / "tools/plan.py"), "--json", "model=mixtral_8x7b", "train.precision=bf16",
           "train.micro_batch_size=1", "train.global_batch_size=128", "plan.gpus_per_node=8", "plan.nodes=2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert {row["ep"] for row in rows} == {1, 2, 4, 8}  # every divisor of the 8 experts that tiles the world
    assert all(row["params_total"] == 46_702_792_704 for row in rows)  # Mixtral-8x7B's published count
    assert all(row["tp"] * row["pp"] * row["dp"] == 16 and (row["tp"] * row["dp"]) % row["ep"] == 0 for row in rows)
    assert {row["cp"] for row in rows} == {1}  # context parallelism is not offered with experts
    fits = [row for row in rows if row["fits"]]
    assert fits and rows[0]["recommended"]
    # more expert parallelism, fewer experts per GPU: less weight memory at the same tp / pp / dp / optimizer
    by_ep = {row["ep"]: row["mem_gb"]["weights_and_optimizer"] for row in rows
             if (row["tp"], row["pp"], row["vpp"], row["dist_opt"], row["recompute"]) == (1, 2, None, True, "full")}
    assert by_ep[8] < by_ep[4] < by_ep[2] < by_ep[1], by_ep


def test_plan_proposes_context_parallel_for_long_sequences():
    """llama3_8b at 32k tokens on 8 x 80 GB: CP layouts listed with their activation memory, which falls as
    cp grows (each rank holds seq/cp tokens), and the recommended layout splits the sequence."""
    cmd = [sys.executable, str(ROOT / "tools/plan.py"), "--json", "model=llama3_8b", "model.seq_length=32768",
           "train.precision=bf16", "train.micro_batch_size=1", "train.global_batch_size=64"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert {row["cp"] for row in rows} == {1, 2, 4, 8}
    assert rows[0]["recommended"] and rows[0]["cp"] > 1
    act = {row["cp"]: row["mem_gb"]["activations"] for row in rows
           if (row["tp"], row["pp"], row["sp"], row["recompute"]) == (1, 1, False, "full")}
    assert act[8] < act[4] < act[2] < act[1], act
    assert all(row["comm_gb"]["cp"] > 0 for row in rows if row["cp"] > 1)
