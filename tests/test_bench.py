"""tools/bench.py times equal work: Megatron-Core's GPTModel, built at our config and layout with our
weights copied in, computes the same loss as our GPT, and after one optimizer step (same gradients,
same update) the same loss again (fp32, relative difference <= 1e-5). Both go through the engine's
own build() and train_step(), as the benchmark runs them. The tool itself runs end to end, our faster RoPE
matches Megatron-Core's (fp32 within 1e-6, bf16 bit-identical; identical across layouts), and our CPU RMSNorm
backward equals autograd's. GPU tier:
the same comparison in bf16, against Megatron-Core's local spec and (when Transformer Engine is installed)
its TE spec.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import run_distributed

ROOT = Path(__file__).resolve().parents[1]
RTOL = 1e-5
VOCAB = 102  # a multiple of tp=2 with make_vocab_size_divisible_by=1: no padded (masked) rows

BASE = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=96",
        "model.seq_length=16", f"model.vocab_size={VOCAB}", "model.make_vocab_size_divisible_by=1",
        "train.micro_batch_size=2", "train.global_batch_size=4", "checkpoint=none", "train.tensorboard=false",
        "optim.warmup_iters=0", "parallel.tp=2"]


def skip_without_a_gpu_per_rank(ranks: int) -> None:
    """With CUDA, rank r computes on GPU r (training/parallel/dist.py select_device): with fewer GPUs than ranks
    the run stops at its LOCAL_RANK check and tests nothing. Without CUDA every rank runs on the CPU (gloo)."""
    if torch.cuda.is_available() and torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} GPUs (one per rank), {torch.cuda.device_count()} visible")


def test_a_test_with_more_ranks_than_gpus_is_skipped_naming_the_count(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    skip_without_a_gpu_per_rank(1)  # one rank, one GPU: runs
    with pytest.raises(pytest.skip.Exception, match=r"^needs 2 GPUs \(one per rank\), 1 visible$"):
        skip_without_a_gpu_per_rank(2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    skip_without_a_gpu_per_rank(2)  # no CUDA: the ranks share the CPU


MODELS = {
    # GQA (4 heads / 2 groups), SwiGLU, RMSNorm, RoPE, tied embeddings, no biases
    "llama": ["model.num_query_groups=2"],
    # MHA, GELU, LayerNorm, learned positions, biases, untied output layer
    "gpt2": ["model.num_query_groups=null", "model.activation=gelu", "model.normalization=LayerNorm",
             "model.position_embedding=learned", "model.add_bias_linear=true", "model.tie_embeddings=false"],
}


def _both_models(models: dict) -> dict:
    """Per model variant: [(loss, grad norm)] of two train_steps, for ours and for Megatron-Core's."""
    from models.shape import ModelShape
    from training.bench import benchmark as bm
    from training.config.compose import compose
    from training.config.validate import validate
    from training.engine.build import build
    from training.engine.step import train_step
    from training.parallel import dist as D

    out = {}
    with D.distributed(tp=2, timeout_minutes=2) as info:  # one process group for every variant
        for name, overrides in models.items():
            cfg = compose(BASE + overrides)
            derived = validate(cfg)
            shape = ModelShape.of(cfg.model, VOCAB)
            ours = build(cfg, shape, info.device)
            mcore = bm.build_mcore(cfg, shape, info.device)
            bm.copy_weights(ours, mcore)
            batch = bm.synthetic_batch(cfg, VOCAB)
            ours_streams, mcore_streams = bm.batch_streams(ours, batch, cfg), bm.batch_streams(mcore, batch, cfg)
            mine = [train_step(ours, ours_streams(), derived, cfg, info.device) for _ in range(2)]
            theirs = [train_step(mcore, mcore_streams(), derived, cfg, info.device, step=bm.mcore_forward_step)
                      for _ in range(2)]
            mine, theirs = ([(r.loss, r.grad_norm) for r in results] for results in (mine, theirs))
            out[name] = {"ours": mine, "mcore": theirs}
    return out


def test_mcore_gptmodel_computes_the_same_loss_and_update_from_the_same_weights():
    skip_without_a_gpu_per_rank(2)  # tp=2
    results = run_distributed(_both_models, world_size=2, args=(MODELS,), timeout=120)
    assert results[0] == results[1], "TP ranks disagree"
    for name, r in results[0].items():
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(r["ours"], r["mcore"])):
            assert loss == pytest.approx(ref_loss, rel=RTOL), (name, step, r)
            assert float(norm) == pytest.approx(float(ref_norm), rel=RTOL), (name, step, r)
        assert r["ours"][1][0] != r["ours"][0][0], "the second step must see updated weights"


@pytest.mark.parametrize("other", ["mcore", "hf"])
def test_bench_tool_smoke_compare_json(other):
    proc = subprocess.run(
        [sys.executable, "tools/bench.py", f"--compare-{other}", "--json", "--breakdown", "--threads", "1",
         "--warmup", "1", "--steps", "1", "--windows", "2", "model.num_layers=2", "model.seq_length=32",
         "train.micro_batch_size=2", "train.global_batch_size=4"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)  # generous: a loaded 2-core machine
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"ours_s", f"{other}_s", "ratio", "tokens_per_s", "tflops_per_device", "mfu", "mem_gb"} <= set(result)
    assert result["ours_s"] > 0 and result[f"{other}_s"] > 0 and result["ratio"] > 0
    assert len(result["window_ratios"]) == 2
    assert result["vocab"] == result["padded_vocab"] == 384  # byte vocabulary 257, padded for both models
    assert result["loss_rel_diff"] <= RTOL
    assert result["mfu"] is None  # no known peak on CPU
    shares = [v for k, v in result["breakdown"].items() if k.endswith("_share")]
    assert sum(shares) == pytest.approx(1.0, abs=1e-6) and all(s > -1e-3 for s in shares)


def test_bench_preference_times_sft_and_dpo_on_the_same_pairs_and_the_reference_as_estimated():
    proc = subprocess.run(
        [sys.executable, "tools/bench.py", "--preference", "--json", "--threads", "1", "--warmup", "1", "--windows",
         "2", "model.num_layers=2", "model.seq_length=32", "train.micro_batch_size=2", "train.global_batch_size=4"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert min(r["sft_s"], r["dpo_stored_s"], r["dpo_live_s"]) > 0 and len(r["window_ratios_live"]) == 2
    assert r["pairs_per_step"] > 4  # packed: several pairs in each of the step's 4 sequences
    assert r["reference_gb_built"] > 0 and r["reference_gb_built"] == pytest.approx(r["reference_gb_estimate"], rel=1e-9)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rope_matches_megatron_core_and_is_identical_across_layouts(dtype):
    """models/attention.py's ApplyRope against Megatron-Core's apply_rotary_pos_emb: fp32 within 1e-6 relative (the
    issue's bound; its addcmul rounds the sum once), bf16 bit-identical; forward and the gradient. And identical,
    bit for bit, on the slices other layouts give a rank: half the heads (TP 2), half the sequence (CP 2)."""
    import torch
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from models.attention import ApplyRope

    dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 64, 2).float() / 64))
    angles = torch.outer(torch.arange(48).float(), inv_freq)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]  # [s, 1, 1, hn], as RotaryEmbedding makes it
    qkv = torch.randn(48, 3, 2, 4 * 64, generator=g).to(dtype).requires_grad_()
    q = qkv[..., :128].reshape(48, 3, 4, 64)  # a strided view, as SelfAttention's q
    grad = torch.randn(48, 3, 4, 64, generator=g).to(dtype)
    ref = _apply_rotary_pos_emb_bshd(q, freqs)
    k = qkv[..., 128:192]  # [s, b, ng, hn], also a strided view
    cos, sin = torch.cos(freqs).to(dtype), torch.sin(angles[:, None, None, :]).to(dtype)  # sin: [s, 1, 1, hn/2]
    ours, ours_k = ApplyRope.apply(q, k, cos, sin)
    ref_k = _apply_rotary_pos_emb_bshd(k, freqs)
    ours_grad = torch.autograd.grad((ours, ours_k), qkv, (grad, grad[:, :, :2]))[0]
    ref_grad = torch.autograd.grad((ref, ref_k), qkv, (grad, grad[:, :, :2]))[0]
    for a, b in ((ours, ref), (ours_k, ref_k), (ours_grad, ref_grad)):
        if dtype == torch.bfloat16:
            assert torch.equal(a, b)
        else:
            assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-6
    with torch.no_grad():
        tp = [ApplyRope.apply(q[:, :, 2 * r:2 * r + 2], k[:, :, r:r + 1], cos, sin) for r in range(2)]  # heads
        cp = [ApplyRope.apply(q[24 * r:24 * r + 24], k[24 * r:24 * r + 24], cos[24 * r:24 * r + 24],
                              sin[24 * r:24 * r + 24]) for r in range(2)]  # sequence halves
    for i, full in enumerate((ours, ours_k)):
        assert torch.equal(torch.cat([t[i] for t in tp], dim=2), full)
        assert torch.equal(torch.cat([t[i] for t in cp], dim=0), full)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_rmsnorm_backward_matches_autograd(dtype):
    """models/norm.py's CPU RMSNorm: torch's forward kernel (bit-identical output), a hand-written backward equal
    to autograd's through F.rms_norm (fp32 within 1e-6; bf16: one rounding of the fp32 result), and gradcheck."""
    import torch
    import torch.nn.functional as F

    from models.norm import RMSNormCPU

    dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 3, 64, generator=g).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(dtype).requires_grad_()
    grad = torch.randn(24, 3, 64, generator=g).to(dtype)
    ref, ours = F.rms_norm(x, (64,), w, 1e-5), RMSNormCPU.apply(x, w, 1e-5)
    assert torch.equal(ours, ref)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for a, b in zip(torch.autograd.grad(ours, (x, w), grad), torch.autograd.grad(ref, (x, w), grad)):
        assert a.dtype == b.dtype and ((a - b).abs().max() / b.abs().max()).item() <= tol
    args = (torch.randn(4, 2, 8, dtype=torch.float64, requires_grad=True),
            torch.randn(8, dtype=torch.float64, requires_grad=True), 1e-5)
    assert torch.autograd.gradcheck(RMSNormCPU.apply, args)


BF16_RTOL = 1e-2  # two implementations of the same bf16 model: rounding differs op by op


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["local", "te"])
def test_gpu_bf16_same_loss_as_mcore_and_timings(spec):
    if spec == "te" and importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("Transformer Engine is not installed")
    skip_without_a_gpu_per_rank(1)  # tools/bench.py's default --nproc 1
    proc = subprocess.run(
        [sys.executable, "tools/bench.py", "--compare-mcore", "--json", "--warmup", "2", "--steps", "3",
         "--windows", "2", "train.precision=bf16", "model.hidden_size=256", "model.ffn_hidden_size=704",
         "model.seq_length=256"] + (["--te"] if spec == "te" else []),
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["loss_rel_diff"] <= BF16_RTOL, result
    assert result["ours_s"] > 0 and result["mcore_s"] > 0 and result["mem_gb"] > 0
    assert result["mcore_mem_gb"] is not None


def test_layout_names_parse_to_processes_and_overrides():
    from training.bench.layouts import parse
    from training.errors import ConfigError

    assert parse("tp1") == (1, []) and parse("single") == (1, [])  # training/parallel/layout.py's names
    assert parse("dp2") == (2, [])
    assert parse("tp2pp2dp2distopt") == (8, ["parallel.tp=2", "parallel.pp=2", "parallel.dist_opt=true"])
    assert parse("tp2sp") == (2, ["parallel.tp=2", "parallel.sp=true"])
    assert parse("dp2zero3") == (2, ["parallel.fsdp=optim_grads_params"])
    assert parse("cp2ep2") == (2, ["parallel.cp=2", "parallel.ep=2"])
    with pytest.raises(ConfigError, match="cannot read 'x3'"):
        parse("tp2x3")


def test_bench_layouts_table_measures_memory_activations_and_communication():
    skip_without_a_gpu_per_rank(2)  # the tp2 row's 2 processes
    proc = subprocess.run(
        [sys.executable, "tools/bench.py", "--layouts", "tp1,tp2", "--json", "--warmup", "1", "--windows", "2",
         "--threads", "1", "model.num_layers=2", "model.seq_length=32", "train.micro_batch_size=2",
         "train.global_batch_size=4"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tp1, tp2 = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (tp1["layout"], tp1["nproc"], tp2["nproc"]) == ("tp1", 1, 2)
    assert tp1["ours_s"] > 0 and tp2["ours_s"] > 0
    # TP2 holds half of every sharded weight (the replicated norms are a small part) and exchanges activations
    assert 0.45 * tp1["state_bytes"] < tp2["state_bytes"] < 0.6 * tp1["state_bytes"], (tp1, tp2)
    assert 0 < tp2["activation_bytes"] < tp1["activation_bytes"]
    assert tp1["comm_share"] < 0.02 and 0.02 < tp2["comm_share"] < 1.0  # one process: nothing to exchange
