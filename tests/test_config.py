"""Config composition and validation: every preset and experiment composes, and each invalid
combination gives its own one-line error before any process group exists."""

from pathlib import Path

import pytest
import torch.distributed as dist

from training.config.compose import CONF_DIR, compose
from training.config.validate import validate
from training.errors import ConfigError

pytestmark = pytest.mark.fast  # the whole module: compose and validate in this process, seconds

INVALID = {
    # overrides, world size, a fragment the one-line error must contain
    "world-not-divisible": (["parallel.tp=2"], 3,
                            "world size 3 is not divisible by parallel.tp * parallel.pp = 2 * 1 = 2"),
    "heads-vs-tp": (["parallel.tp=8"], 8, "model.num_attention_heads=4 is not divisible by parallel.tp=8"),
    "groups-vs-tp": (["parallel.tp=4"], 4, "model.num_query_groups=2 is not divisible by parallel.tp=4"),
    "heads-vs-groups": (["model.num_query_groups=3"], 1,
                        "model.num_attention_heads=4 is not divisible by model.num_query_groups=3"),
    "layers-vs-pp": (["parallel.pp=3"], 3, "model.num_layers=4 is not divisible by parallel.pp * vpp = 3 * 1 = 3"),
    "layers-vs-vpp": (["parallel.pp=2", "parallel.vpp=4"], 2,
                      "model.num_layers=4 is not divisible by parallel.pp * vpp = 2 * 4 = 8"),
    "batch-vs-micro-dp": (["train.global_batch_size=12", "train.micro_batch_size=4"], 2,
                          "train.global_batch_size=12 is not divisible by train.micro_batch_size * dp = 4 * 2 = 8: "
                          "set train.global_batch_size to a multiple of 8 (e.g. 16), or train.micro_batch_size=3 "
                          "(12 = 3 * dp 2 * 2 accumulation step(s))"),
    "default-batch-on-8": ([], 8, "train.global_batch_size=16 is not divisible by train.micro_batch_size * dp = 4 * 8 "
                                  "= 32: set train.global_batch_size to a multiple of 32 (e.g. 32), or "
                                  "train.micro_batch_size=2 (16 = 2 * dp 8 * 1 accumulation step(s))"),
    "no-process": ([], 0, "world size 0: start at least one process (NPROC >= 1)"),
    "sp-needs-tp": (["parallel.sp=true"], 1, "parallel.sp=true needs parallel.tp > 1"),
    "vpp-needs-pp": (["parallel.vpp=2"], 1, "parallel.vpp=2 needs parallel.pp > 1 (got pp=1)"),
    "seq-vs-tp-under-sp": (["parallel.tp=2", "parallel.sp=true", "model.seq_length=127"], 2,
                           "model.seq_length=127 is not divisible by parallel.tp=2"),
    "interleaved-microbatches": (["parallel.pp=2", "parallel.vpp=2", "train.global_batch_size=4",
                                  "train.micro_batch_size=4"], 2,
                                 "needs micro-batches per step divisible by parallel.pp"),
    "hidden-vs-heads": (["model.hidden_size=130"], 1,
                        "model.hidden_size=130 is not divisible by model.num_attention_heads=4: set model.kv_channels"),
    "param-gather-needs-distopt": (["parallel.overlap_param_gather=true", "parallel.overlap_grad_reduce=true"], 1,
                                   "parallel.overlap_param_gather=true needs parallel.dist_opt=true"),
    # choices are Enums in the schema: refused while composing, in one line
    "precision-choice": (["train.precision=fp16"], 1,
                         "train.precision: Invalid value 'fp16', expected one of [fp32, bf16]"),
    "recompute-choice": (["model.recompute=some"], 1,
                         "model.recompute: Invalid value 'some', expected one of [none, selective, full]"),
    "activation-choice": (["model.activation=relu"], 1,
                          "model.activation: Invalid value 'relu', expected one of [gelu, swiglu, geglu_tanh, clamped_swiglu]"),
    "fused-kernels-bool": (["model.fused_kernels=maybe"], 1, "model.fused_kernels: Value 'maybe' is not a valid bool"),
    "comma-value": (["data.split=98,2,0"], 1, "data.split=98,2,0: a value with commas needs quotes (text, as "
                                              "data.split: \"data.split='98,2,0'\") or brackets"),
    "unknown-group-option": (["model=lama"], 1, "model=lama: no such config in conf/model/ (did you mean llama_1b? "
                                                "choose from deepseek_v3, gemma2_27b,"),
    "unknown-key": (["model.num_experts=8"], 1,
                    "unknown key 'model.num_experts' (did you mean model.moe.num_experts?)"),
    "integer-field": (["train.iters=ten"], 1,
                      "train.iters: Value 'ten' of type 'str' could not be converted to Integer"),
    "unknown-block": (["model.mlp=sparse"], 1,
                      "model.mlp=sparse: unknown block 'sparse': use one of self_attention, mlp, gated_mlp, mla, moe"),
    "moe-by-name": (["model.mlp=moe"], 1, "model.mlp=moe: MoE layers come from model.moe.num_experts"),
    "ep-without-moe": (["parallel.ep=2"], 2,
                       "parallel.ep=2 / parallel.etp=1 split experts: they need a mixture-of-experts model"),
    "experts-vs-ep": (["model=moe_tiny", "parallel.ep=3"], 3,
                      "model.moe.num_experts=8 is not divisible by parallel.ep=3"),
    "expert-layout-vs-world": (["model=moe_tiny", "parallel.ep=4", "train.global_batch_size=8",
                                "train.micro_batch_size=4"], 2,
                               "world size 2 is not divisible by parallel.pp * ep * etp = 1 * 4 * 1 = 4"),
    "moe-tp-needs-sp": (["model=moe_tiny", "parallel.tp=2"], 2,
                        "a mixture of experts with parallel.tp=2 needs parallel.sp=true"),
    "router-bias-softmax": (["model=moe_tiny", "model.moe.router_expert_bias=true"], 1,
                            "model.moe.router_expert_bias=true needs model.moe.score_function=sigmoid (is softmax)"),
    "router-groups": (["model=moe_tiny", "model.moe.router_num_groups=3", "model.moe.router_group_topk=1"], 1,
                      "model.moe.router_num_groups=3 and router_group_topk=1: both or neither; the 8 experts"),
    "mla-sinks": (["model.attention=mla", "model.attention_sinks=true"], 1,
                  "model.attention=mla does not implement model.attention_sinks=True (use False)"),
    "mla-rope-dim": (["model.attention=mla", "model.mla.qk_rope_head_dim=7"], 1,
                     "model.mla.qk_rope_head_dim=7 must be even and >= 2"),
    "moe-top-k": (["model=moe_tiny", "model.moe.top_k=9"], 1,
                  "model.moe.top_k=9 must be between 1 and model.moe.num_experts=8"),
    "moe-bias-etp": (["model=moe_tiny", "model.add_bias_linear=true", "parallel.etp=2", "parallel.ep=2"], 4,
                     "model.add_bias_linear=true (experts with biases, gpt-oss) with parallel.etp=2: Megatron-Core's"),
    "moe-etp-vs-ffn": (["model=moe_tiny", "parallel.etp=3"], 3,
                       "model.moe.ffn_hidden_size=176 is not divisible by parallel.etp=3"),
    "moe-dispatcher": (["model=moe_tiny", "model.moe.dispatcher=flex"], 1,
                       "model.moe.dispatcher: Invalid value 'flex', expected one of [alltoall, allgather]"),
    "block-not-importable": (["model.mlp=models.nowhere:MLP"], 1,
                             "block 'models.nowhere:MLP': cannot import models.nowhere:MLP"),
    "block-without-counts": (["model.mlp=torch.nn:Linear"], 1,
                             "block torch.nn:Linear has no num_params or flops_per_token"),
    "cp-vs-world": (["parallel.cp=2"], 3, "world size 3 is not divisible by parallel.tp * pp * cp = 1 * 1 * 2 = 2"),
    "cp-vs-seq": (["parallel.cp=2", "model.seq_length=126"], 2,
                  "model.seq_length=126 is not divisible by 2 * parallel.cp = 2 * 2 = 4"),
    "cp-sp-vs-seq": (["parallel.cp=2", "parallel.tp=2", "parallel.sp=true", "model.seq_length=36"], 4,
                     "model.seq_length=36 is not divisible by 2 * parallel.cp * tp = 2 * 2 * 2 = 8"),
    "cp-with-moe": (["model=moe_tiny", "parallel.cp=2"], 2, "parallel.cp=2 with a mixture of experts is not supported"),
    "fsdp-with-pp": (["parallel.fsdp=optim_grads_params", "parallel.pp=2"], 2,
                     "parallel.fsdp=optim_grads_params is tested here with TP, SP and DP only: drop parallel.pp=2"),
    "fsdp-with-moe": (["model=moe_tiny", "parallel.fsdp=optim_grads"], 1,
                      "parallel.fsdp=optim_grads is tested here with TP, SP and DP only: drop model.moe.num_experts"),
    "fsdp-choice": (["parallel.fsdp=zero3"], 1, "parallel.fsdp: Invalid value 'zero3', expected one of [none, "),
    "lr-below-min": (["optim.lr=1e-5", "optim.min_lr=1e-4"], 1, "optim.lr=1e-05 must be >= optim.min_lr=0.0001"),
    "dropout-range": (["model.hidden_dropout=1.5"], 1, "dropout must be in [0, 1)"),
    # models/gated_mlp.py (the README's example block) computes act(gate) * up: it trained silently as quick_gelu
    "gated-mlp-clamped-swiglu": (["model.mlp=gated_mlp", "model.activation=clamped_swiglu"], 1,
                                 "model.mlp=gated_mlp computes act(gate) * up, not model.activation=clamped_swiglu's "
                                 "clamps and up + 1: use model.mlp=mlp"),
    "learned-positions-beyond-table": (["model=gpt2_124m", "model.max_position_embeddings=1024",
                                        "model.seq_length=2048"], 1, "model.seq_length=2048 > "
                                       "model.max_position_embeddings=1024: learned position embeddings have a row"),
    "blend-weights-count": (["data.paths=[a,b]", "data.weights=[1.0]"], 1,
                            "data.weights has 1 entries but data.paths has 2"),
    "missing-checkpoint": (["checkpoint.load=/nonexistent/ckpt"], 1,
                           "checkpoint.load=/nonexistent/ckpt does not exist"),
    "async-save-with-fsdp": (["parallel.fsdp=optim_grads", "checkpoint.async_save=true"], 1,
                             "checkpoint.async_save=true writes Megatron-Core's torch_dist format; "
                             "parallel.fsdp=optim_grads saves synchronously"),
    "zero-micro-batch": (["train.micro_batch_size=0"], 1, "train.micro_batch_size=0 must be >= 1"),
    "sft-without-data": (["data.format=sft"], 1, "data.format=sft needs data.paths: conversations written by "
                                                 "tools/preprocess_data.py --format sft"),
    "sft-with-cp": (["data.format=sft", "data.paths=[a]", "parallel.cp=2"], 2,
                    "data.format=sft with parallel.cp=2: context parallelism does not take packed sequences"),
    "sft-with-weights": (["data.format=sft", "data.paths=[a,b]", "data.weights=[1,2]"], 1,
                         "data.format=sft reads data.paths one after another: remove data.weights=[1.0, 2.0]"),
    "format-choice": (["data.format=chat"], 1, "data.format: Invalid value 'chat', expected one of [text, sft, pref"),
    "preference-without-objective": (["data.format=preference", "data.paths=[a]"], 1,
                                     "data.format=preference trains with a preference objective: add post=dpo"),
    "objective-without-pairs": (["post=dpo", "post.reference_load=a"], 1,
                                "post.objective=sigmoid trains on preference pairs: set data.format=preference"),
    "simpo-with-reference": (["post=simpo", "post.reference=live", "data.format=preference", "data.paths=[a]"], 1,
                             "post.objective=simpo is reference-free: set post.reference=none (it is live)"),
    "lora-base-without-lora": (["post=dpo", "post.reference=lora_base", "data.format=preference",
                                "data.paths=[a]"], 1, "post.reference=lora_base is the policy with its adapters off"),
    "stored-without-a-model": (["post=dpo", "data.format=preference", "data.paths=[a]"], 1,
                             "post.reference=stored scores with the reference model"),
    "preference-cp": (["post=dpo", "post.reference_load=a", "data.format=preference", "data.paths=[a]",
                       "parallel.cp=2"], 2, "data.format=preference with parallel.cp=2: context parallelism does "
                                            "not take packed sequences"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_config_is_a_one_line_error_before_any_process_group(case):
    overrides, world, fragment = INVALID[case]
    with pytest.raises(ConfigError) as err:
        validate(compose(overrides), world)
    lines = str(err.value).splitlines()
    assert any(fragment in line for line in lines), lines
    assert len([line for line in lines if fragment in line]) == 1
    assert not dist.is_initialized()


def test_dataclass_defaults_are_the_default_run():
    """training/config/schema.py's defaults equal what conf/config.yaml's default groups compose (the run dir's
    config.yaml of a default run), so the schema documents the run a user gets."""
    from training.config.schema import Config

    assert compose([]) == Config()


def test_several_problems_are_all_reported_one_per_line():
    cfg = compose(["parallel.sp=true", "parallel.vpp=2"])
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    assert len(str(err.value).splitlines()) == 2


def test_derived_sizes():
    cfg = compose(["parallel.tp=2", "train.global_batch_size=32", "train.micro_batch_size=2"])
    layout = validate(cfg, 8)
    assert (layout.dp, layout.num_microbatches, layout.world) == (4, 4, 8)
    assert "global batch 32 = micro 2 x dp 4 x accumulation 4" in layout.describe()


@pytest.mark.parametrize("group,name", [(p.parent.name, p.stem) for p in sorted(CONF_DIR.glob("*/*.yaml"))])
def test_every_config_file_composes(group, name):
    cfg = compose([f"{group}={name}"])
    assert cfg.model.num_layers >= 1


def test_presets_have_the_published_shapes():
    llama2 = compose(["model=llama2_7b"]).model
    assert (llama2.num_layers, llama2.hidden_size, llama2.num_attention_heads, llama2.ffn_hidden_size,
            llama2.vocab_size, llama2.activation, llama2.normalization, llama2.tie_embeddings) == \
        (32, 4096, 32, 11008, 32000, "swiglu", "RMSNorm", False)
    llama3 = compose(["model=llama3_8b"]).model
    assert (llama3.num_query_groups, llama3.vocab_size, llama3.rotary_base) == (8, 128256, 500000.0)


def test_check_config_cli_prints_one_line_per_problem(tmp_path):
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, WORLD_SIZE="3")
    proc = subprocess.run([sys.executable, str(root / "tools/check_config.py"), "parallel.tp=2"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: world size 3 is not divisible by parallel.tp * parallel.pp = 2 * 1 = 2: start a multiple "
        "of 2 processes (NPROC) or change tp/pp"]
    import socket

    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env["WORLD_SIZE"] = "2"
        proc = subprocess.run([sys.executable, str(root / "tools/check_config.py"), "--port", str(port)],
                              capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert f"MASTER_PORT={port} is not free" in proc.stderr


UNKNOWN = {  # override -> the one line: with or without `+`, in a {...} value, a group's name, a bare leaf name;
    # or a group added with `+`
    "paralel.tp=2": "unknown key 'paralel.tp' (did you mean parallel.tp?)",
    "+paralel.tp=2": "unknown key 'paralel.tp' (did you mean parallel.tp?)",
    "++train.iter=5": "unknown key 'train.iter' (did you mean train.iters?)",
    "~paralel.tp": "unknown key 'paralel.tp' (did you mean parallel.tp?)",
    "model.moe={topk:1}": "unknown key 'model.moe.topk' (did you mean model.moe.top_k?)",
    "paralel=tp2_sp": "unknown key 'paralel' (did you mean parallel?)",
    "tp=2": "unknown key 'tp' (did you mean parallel.tp?)",
    "+zzz=1": "unknown key 'zzz' (the keys are in training/config/schema.py)",
    # names people bring (training/config/aliases.py): not the nearest spelling (parallel.overlap_param_gather)
    "parallel.tensor_parallel=2": "unknown key 'parallel.tensor_parallel' (did you mean parallel.tp?)",
    "tensor_model_parallel_size=2": "unknown key 'tensor_model_parallel_size' (Megatron-LM's name; here: parallel.tp)",
    "parallelism.pipeline_parallel_degree=2": "unknown key 'parallelism.pipeline_parallel_degree' (torchtitan's "
                                              "name; here: parallel.pp)",
    "learning_rate=1e-4": "unknown key 'learning_rate' (HF's name; here: optim.lr)",
    "train.max_step=5": "unknown key 'train.max_step' (like HF's max_steps; here: train.iters)",
    # a group that conf/config.yaml already selects (Hydra: "Multiple values for experiment...")
    "+experiment=tiny_tp2_sp": "'+experiment=...' adds a config group, but experiment is already one "
                               "(conf/config.yaml's defaults): write experiment=tiny_tp2_sp",
}


@pytest.mark.parametrize("override", list(UNKNOWN))
def test_unknown_keys_are_refused_naming_the_nearest(override):
    with pytest.raises(ConfigError) as err:
        compose([override])
    assert str(err.value) == UNKNOWN[override]


def test_hydra_settings_and_group_selections_still_compose(tmp_path):
    cfg = compose([f"hydra.run.dir={tmp_path}", f"hydra.searchpath=[file://{tmp_path}]", "hydra/job_logging=stdout",
                   "model=qwen3_8b", "parallel=tp2_sp", "++model.moe.top_k=3"])
    assert (cfg.model.name, cfg.parallel.tp, cfg.model.moe.top_k) == ("qwen3_8b", 2, 3)
    assert compose(["experiment=tiny_tp2_sp"]).parallel.sp and compose(["~experiment"]) == compose([])


def test_launcher_refuses_an_added_unknown_key_before_starting(tmp_path):
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, NPROC="1", RUN_DIR=str(tmp_path / "run"))
    proc = subprocess.run([str(root / "launch/train.sh"), "+paralel.tp=2", "train.iters=0", "checkpoint.dir=null"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [
        "error: unknown key 'paralel.tp' (did you mean parallel.tp?)"]
    assert not (tmp_path / "run").exists()  # no process started


def test_learning_rates_follow_the_run_and_say_so():
    """Null optim.lr / min_lr resolve by run kind (from scratch, full fine-tune, LoRA) into what Megatron-Core's
    optimizer and schedule get (training/engine/bridge.py), min_lr a tenth of the peak unless given; setting
    optim.lr alone is always valid; the config line names the source."""
    from training.config import optim_defaults as od
    from training.engine import bridge

    tune = ["checkpoint.load=/tmp", "checkpoint.finetune=true"]
    for overrides, peak, words in (([], od.PRETRAIN_LR, "the pretraining default"),
                                   (tune, od.FULL_FINETUNE_LR, "the full fine-tune default"),
                                   (["peft=lora"], od.LORA_LR, "the LoRA default"),
                                   ([*tune, "peft=lora"], od.LORA_LR, "the LoRA default"),
                                   ([*tune, "optim.lr=1e-5"], 1e-5, "optim.lr, min lr/10"),
                                   (["optim.lr=1e-5"], 1e-5, "optim.lr, min lr/10"),
                                   (["optim.lr=1e-5", "optim.min_lr=0"], 1e-5, "optim.lr, min optim.min_lr")):
        cfg = compose(overrides)
        validate(cfg, 1)
        kwargs, optimizer = bridge.scheduler_kwargs(cfg), bridge.optimizer_config(cfg)
        end = 0.0 if "optim.min_lr=0" in overrides else peak / 10
        assert (kwargs["max_lr"], kwargs["min_lr"], optimizer.lr, optimizer.min_lr) == pytest.approx((peak, end, peak, end)), overrides
        assert words in od.describe(cfg) and f"lr {peak:.0e} -> {end:.0e}" in od.describe(cfg), od.describe(cfg)


def test_a_sequence_past_the_checkpoints_context_is_a_note_with_rope():
    from training.config.validate import notes

    assert notes(compose(["model.max_position_embeddings=64", "model.seq_length=64"])) == []
    (note,) = notes(compose(["model.max_position_embeddings=32", "model.seq_length=64"]))
    assert note.startswith("note: model.seq_length=64 > model.max_position_embeddings=32, the context the checkpoint "
                           "was trained for: RoPE runs past it"), note
    validate(compose(["model.max_position_embeddings=32", "model.seq_length=64"]), 1)  # allowed
