"""tools/bench.py times equal work: Megatron-Core's GPTModel, built at our config and layout with our
weights copied in, computes the same loss as our GPT, and after one optimizer step (same gradients,
same update) the same loss again (fp32, relative difference <= 1e-5). Both go through the engine's
own build() and train_step(), as the benchmark runs them. The tool itself runs end to end, our
faster RoPE is bit-identical to Megatron-Core's, and our CPU RMSNorm backward equals autograd's. GPU tier:
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


HF_OVERRIDES = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
                "model.ffn_hidden_size=96", "model.seq_length=16", f"model.vocab_size={VOCAB}",
                "model.make_vocab_size_divisible_by=1", "train.micro_batch_size=2", "train.global_batch_size=4",
                "checkpoint=none", "train.tensorboard=false", "optim.warmup_iters=2", "train.iters=5",
                "optim.adam_eps=1e-4"]


def _ours_and_hf(steps: int) -> dict:
    """Ours and transformers' Llama from the same weights, `steps` training steps each: losses, grad norms,
    learning rates, and the weights after (ours in HF names)."""
    from models.gpt import to_hf
    from models.shape import ModelShape
    from training.bench import bench_hf
    from training.bench import benchmark as bm
    from training.config.compose import compose
    from training.config.validate import validate
    from training.engine.build import build
    from training.engine.step import train_step
    from training.interop import hf
    from training.parallel import dist as D
    from training.parallel.wrap import unwrap

    cfg = compose(HF_OVERRIDES)
    derived = validate(cfg)
    with D.distributed(timeout_minutes=2) as info:
        ours = build(cfg, ModelShape.of(cfg.model, VOCAB), info.device)
        side = bench_hf.build_hf(ours, cfg, info.device)
        batch = bm.synthetic_batch(cfg, VOCAB)
        streams, micro = bm.batch_streams(ours, batch, cfg), bench_hf.micro_batches(batch, 2, info.device)
        out = {"ours": [], "hf": [], "ours_grads": None}
        for _ in range(steps):
            r = train_step(ours, streams(), derived, cfg, info.device)
            out["ours"].append((r.loss, r.grad_norm, ours.optimizer.param_groups[0]["lr"]))
            lr = side.optimizer.param_groups[0]["lr"]  # the lr this step used (the scheduler steps after it)
            out["hf"].append((*bench_hf.hf_train_step(side, micro), lr))
            if not out["ours_grads"]:  # the first step's gradients, before any update
                params = dict(unwrap(ours.model[0]).named_parameters())
                out["ours_grads"] = {n: g.clone() for n, g in to_hf(lambda n: params[n].main_grad,
                                                                     ours.config, ours.shape)}
                out["hf_grads"] = {n: p.grad.clone() for n, p in side.model.named_parameters()}
        out["ours_weights"] = {name: t.clone() for name, t in hf.hf_tensors(ours)}
        out["hf_weights"] = {n: p.detach().clone() for n, p in side.model.named_parameters()}
    return out


def test_hf_llama_with_plain_adamw_takes_the_same_steps():
    """--compare-hf times equal work: every step's loss, grad norm and learning rate, and the first step's
    gradients, and the weights after the updates (warmup from lr 0, then cosine decay; clipping and weight
    decay on), all equal to 1e-5."""
    (r,) = run_distributed(_ours_and_hf, world_size=1, args=(4,), timeout=120)
    for step, ((loss, norm, lr), (ref_loss, ref_norm, ref_lr)) in enumerate(zip(r["ours"], r["hf"])):
        assert loss == pytest.approx(ref_loss, rel=RTOL), (step, r["ours"], r["hf"])
        assert norm == pytest.approx(ref_norm, rel=RTOL), (step, r["ours"], r["hf"])
    # lr of the step before the scheduler stepped it: ours reads it after, so ours[k] is hf[k + 1]
    assert [lr for *_, lr in r["ours"][:-1]] == pytest.approx([lr for *_, lr in r["hf"][1:]], rel=1e-12)
    assert r["hf"][0][2] == 0.0 and r["hf"][2][2] > 0  # warmup starts at 0, as Megatron-Core's scheduler does
    assert len({loss for loss, *_ in r["ours"]}) == 3, "steps 2-4 must see updated weights (step 1 has lr 0)"
    assert set(r["ours_weights"]) == set(r["hf_weights"]) == set(r["ours_grads"]) == set(r["hf_grads"])
    for name, ref in r["hf_grads"].items():  # measured <= 4.5e-7
        diff = (r["ours_grads"][name] - ref).abs().max() / ref.abs().max()
        assert diff <= RTOL, ("gradient", name, float(diff))
    # Adam divides each gradient element by its own RMS: with eps 1e-8 an element whose gradient is tiny keeps
    # its last-bit difference as an O(lr) step (measured 3.4e-5 and 1.2e-4 apart after 3 updates, by luck of
    # the rounding). eps 1e-4 (HF_OVERRIDES, both sides) keeps such elements linear: 1.1e-6 measured
    for name, ref in r["hf_weights"].items():
        diff = (r["ours_weights"][name] - ref).abs().max() / ref.abs().max()
        assert diff <= RTOL, ("weight", name, float(diff))


@pytest.mark.parametrize("other", ["mcore", "hf"])
def test_bench_tool_smoke_compare_json(other):
    proc = subprocess.run(
        [sys.executable, "tools/bench.py", f"--compare-{other}", "--json", "--breakdown", "--threads", "1",
         "--warmup", "1", "--steps", "1", "--windows", "2", "model.num_layers=2", "model.seq_length=32",
         "train.micro_batch_size=2", "train.global_batch_size=4"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rope_is_bit_identical_to_megatron_core(dtype):
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
    ours, ours_k = ApplyRope.apply(q, k, torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype))
    ref_k = _apply_rotary_pos_emb_bshd(k, freqs)
    assert torch.equal(ours, ref) and torch.equal(ours_k, ref_k)
    ours_grad = torch.autograd.grad((ours, ours_k), qkv, (grad, grad[:, :, :2]))[0]
    assert torch.equal(ours_grad, torch.autograd.grad((ref, ref_k), qkv, (grad, grad[:, :, :2]))[0])


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
