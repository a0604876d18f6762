"""tools/generate.py and the KV cache (models/kv_cache.py): greedy decoding of an imported Hugging Face Llama
equals transformers' generate() token for token (two prompts of different lengths in one batch, at TP1 and PP2;
TP2: tests/test_hf_families.py for Llama 3, Qwen2, Qwen3 and Qwen3-MoE); logits with the cache equal each
sequence's forward without a cache at every step, for every cached attention kind (GQA, learned positions, MLA,
a sliding window, sinks) on models whose attention depends on position; seeded sampling is reproducible and the
same at TP1 and TP2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import TOOL_NOISE, run_distributed

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The quick brown fox", "Hi"]  # byte ids, lengths 19 and 2: the short one is left-padded
NEW = 32
EOD = 256  # the byte tokenizer's end of document, also HF's eos here


def _import_llama(root: str) -> dict:
    """A random HF Llama (GQA, untied, vocabulary 301) imported with tools/convert_hf.py, and transformers'
    greedy continuation of each prompt on its own."""
    import transformers
    from test_convert_hf import _hf_model

    from training.data.tokenizer import ByteTokenizer

    sys.path.insert(0, str(ROOT / "tools"))
    import convert_hf

    hf_dir = _hf_model(Path(root) / "hf", tied=False)
    assert convert_hf.main(["import", "--hf-dir", str(hf_dir), "--out", f"{root}/ckpt",
                            "--preset-out", f"{root}/preset.yaml"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    expected = []
    for text in PROMPTS:
        ids = torch.tensor([ByteTokenizer().encode(text)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=EOD, pad_token_id=0)
        expected.append(out[0, ids.shape[1]:].tolist())
    return {"expected": expected}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    (result,) = run_distributed(_import_llama, 1, (str(root),), timeout=300)
    return root / "ckpt", result["expected"]


def generate(ckpt: Path, *args: str, nproc: int = 1) -> list[dict]:
    cmd = [sys.executable, "tools/generate.py", "--ckpt", str(ckpt), *[a for p in PROMPTS for a in ("--prompt", p)],
           "--max-new-tokens", str(NEW), "--json", "--nproc", str(nproc), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not TOOL_NOISE.search(proc.stdout + proc.stderr), proc.stderr  # quiet tools, workers included
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("layout", ["tp1", "pp2"])  # tp2: tests/test_hf_families.py, four families
def test_greedy_equals_transformers_generate(imported, layout):
    ckpt, expected = imported
    extra = {"tp1": [], "pp2": ["parallel.pp=2"]}[layout]
    lines = generate(ckpt, "--greedy", *extra, nproc=1 if layout == "tp1" else 2)
    assert [line["prompt"] for line in lines] == PROMPTS
    assert [line["prompt_ids"] for line in lines] == [list(p.encode()) for p in PROMPTS]
    assert [line["new_ids"] for line in lines] == expected  # token for token
    assert all(len(ids) == NEW or ids[-1] == EOD for ids in expected)


def test_seeded_sampling_is_reproducible_and_the_same_at_tp2(imported):
    ckpt, _ = imported
    args = ["--temperature", "0.9", "--top-k", "50", "--top-p", "0.95", "--seed", "5"]
    first, again, tp2 = generate(ckpt, *args), generate(ckpt, *args), generate(ckpt, *args, "parallel.tp=2", nproc=2)
    assert [line["new_ids"] for line in first] == [line["new_ids"] for line in again] == \
        [line["new_ids"] for line in tp2]
    other = generate(ckpt, *args[:-1], "6")  # another seed, another draw
    assert [line["new_ids"] for line in other] != [line["new_ids"] for line in first]


def test_a_layout_that_does_not_fit_nproc_is_the_last_line_exit_2(imported):
    """--nproc 2 with tp 3: the worker's error is the last line (not torch's "Terminating process ..." of its peer)."""
    ckpt, _ = imported
    proc = subprocess.run([sys.executable, "tools/generate.py", "--ckpt", str(ckpt), "--prompt", "x", "--nproc", "2",
                           "parallel.tp=3"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "error: generation runs one model replica: 2 processes but parallel.tp * pp = 3 * 1 = 3 (start tp * pp "
        "processes: --nproc 3)"), proc.stderr[-2000:]


# the cached attention kinds: GQA with RoPE, learned positions, MLA (its latent and rotated k_pe cached), a sliding
# window shorter than the decoded length (4 < 19 positions), sinks (MLA takes neither: the config refuses them)
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=96", "model.seq_length=32",
         "checkpoint=none"]
WINDOW = ["model.sliding_window=4", "model.layer_types=[sliding,full]"]
MLA = ["model.attention=mla", "model.num_query_groups=null", "model.mla.q_lora_rank=24", "model.mla.kv_lora_rank=16",
       "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=12",
       "model.rope_scaling.type=yarn", "model.rope_scaling.factor=4", "model.rope_scaling.original_max_position=8"]
CACHED = {"gqa": SMALL, "sinks": [*SMALL, "model.attention_sinks=true"], "window": [*SMALL, *WINDOW],
          "learned": [*SMALL, "model.position_embedding=learned", "model.normalization=LayerNorm",
                      "model.activation=gelu", "model.num_query_groups=4"],
          "mla": [*SMALL, *MLA]}
SHARP = 5.0  # q and k weights scaled up: attention far from uniform, so a position bug changes the logits


def _cache_vs_no_cache(variants: dict) -> dict:
    """For each model variant (attention weights scaled by SHARP): the last position's logits at every step of a
    decoding with the KV cache (a left-padded batch: prefill, then one token a step), and each sequence's own
    forward without a cache (no padding, the whole prefix: the training path's masks and positions); and the
    logits with the last token one position early (how far a position bug moves them)."""
    from models.kv_cache import KVCache
    from models.shape import ModelShape
    from training.config.compose import compose
    from training.engine.build import build
    from training.interop.generation import last_logits
    from training.parallel import dist as D

    out = {}
    with D.distributed(timeout_minutes=2) as info:
        for name, overrides in variants.items():
            cfg = compose(overrides)
            state = build(cfg, ModelShape.of(cfg.model, 257), info.device, train=False)
            gpt = state.model[0].eval()
            with torch.no_grad():
                for pname, p in gpt.named_parameters():
                    if "self_attention" in pname and p.dim() == 2 and "linear_proj" not in pname:
                        p.mul_(SHARP)
            g = torch.Generator().manual_seed(0)
            prompts = [torch.randint(0, 257, (n,), generator=g).tolist() for n in (9, 3)]
            pad = torch.tensor([0, 6])
            tokens = torch.tensor([prompts[0], [0] * 6 + prompts[1]])
            cache, step_input, steps = KVCache(9 + 10, pad), tokens, []
            for _ in range(10):  # to position 18
                cached = last_logits(state, step_input, cache, 2)
                with torch.no_grad():
                    alone = [tokens[i:i + 1, int(pad[i]):] for i in range(2)]
                    full = torch.cat([gpt(t)[:, -1].float() for t in alone])
                    # the last token one position early (RoPE is relative: moving them all would change nothing)
                    moved = [torch.arange(t.shape[1]).clamp(max=t.shape[1] - 2)[None] for t in alone]
                    shifted = torch.cat([gpt(t, position_ids=m, segment_ids=torch.ones_like(t))[:, -1].float()
                                         for t, m in zip(alone, moved)])
                steps.append((cached, full, shifted))
                picked = torch.randint(0, 257, (2,), generator=g)  # any continuation
                tokens, step_input = torch.cat([tokens, picked[:, None]], dim=1), picked[:, None]
            out[name] = steps
    return out


def test_kv_cache_logits_equal_a_forward_without_cache():
    (results,) = run_distributed(_cache_vs_no_cache, 1, (CACHED,), timeout=300)
    for name, steps in results.items():
        moved = []
        for step, (cached, full, shifted) in enumerate(steps):
            real = torch.isfinite(full)  # the padded vocabulary rows are -inf in all
            assert torch.equal(real, torch.isfinite(cached))
            diff = ((cached[real] - full[real]).abs().max() / full[real].abs().max()).item()
            assert diff <= 1e-5, (name, step, diff)
            moved.append(((shifted[real] - full[real]).abs().max() / full[real].abs().max()).item())
        assert min(moved) > 1e-2, (name, moved)  # positions matter: a position bug would show


# ---- sampling filters (training/interop/generation.py sample): empirical frequencies of many draws ----------
# One row per draw: sample() takes one uniform per row, so N identical rows are N independent draws.
PROBS = [0.1, 0.4, 0.04, 0.25, 0.06, 0.15]  # by token id; sorted: 1 (.4), 3 (.25), 5 (.15), 0 (.1), 4, 2
DRAWS = 20000  # a frequency's standard deviation <= 0.0036: the 0.015 tolerance is > 4 of them


def _frequencies(probs: list[float], **sampling) -> torch.Tensor:
    from training.interop.generation import Sampling, sample

    logits = torch.tensor(probs, dtype=torch.float64).log().float().expand(DRAWS, -1)
    ids = sample(logits, Sampling(greedy=False, **sampling), torch.Generator().manual_seed(0))
    return torch.bincount(ids, minlength=len(probs)).double() / DRAWS


def _expected(probs: list[float], kept: set[int], power: float = 1.0) -> torch.Tensor:
    weights = torch.tensor([p ** power if i in kept else 0.0 for i, p in enumerate(probs)], dtype=torch.float64)
    return weights / weights.sum()


def _support(frequencies: torch.Tensor) -> set[int]:
    return set(torch.nonzero(frequencies).flatten().tolist())


@pytest.mark.parametrize("k, kept", [(1, {1}), (3, {1, 3, 5}), (5, {1, 3, 5, 0, 4}), (0, set(range(6)))])
def test_top_k_keeps_exactly_the_k_most_likely(k, kept):
    freq = _frequencies(PROBS, top_k=k)
    assert _support(freq) == kept, freq
    assert torch.allclose(freq, _expected(PROBS, kept), atol=0.015), freq  # renormalised over the kept tokens


@pytest.mark.parametrize("p, kept", [(0.3, {1}), (0.4 + 1e-6, {1, 3}), (0.7, {1, 3, 5}), (0.8 + 1e-6, {1, 3, 5, 0}),
                                     (1.0, set(range(6)))])
def test_top_p_keeps_the_smallest_set_reaching_p(p, kept):
    freq = _frequencies(PROBS, top_p=p)
    assert _support(freq) == kept, (p, freq)
    assert torch.allclose(freq, _expected(PROBS, kept), atol=0.015), (p, freq)


@pytest.mark.parametrize("p, size", [(0.25, 1), (0.5, 2), (0.75, 3), (0.5 + 1e-9, 3)])
def test_top_p_boundary_a_set_with_mass_exactly_p_is_enough(p, size):
    """Four equal logits: probabilities exactly 1/4, so the masses 1/4, 1/2, 3/4 are exact in float64."""
    freq = _frequencies([1.0, 1.0, 1.0, 1.0, 0.0], top_p=p)  # log(0) = -inf: never drawn
    assert len(_support(freq)) == size and 4 not in _support(freq), (p, freq)
    assert torch.allclose(freq[freq > 0], torch.full((size,), 1 / size, dtype=torch.float64), atol=0.015), freq


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sharpens_below_one_and_flattens_above(temperature):
    """softmax(log p / T) = p^(1/T), renormalised: the most likely token's 0.40 becomes 0.61 at T = 0.5, 0.28 at 2."""
    freq = _frequencies(PROBS, temperature=temperature)
    assert torch.allclose(freq, _expected(PROBS, set(range(6)), 1 / temperature), atol=0.015), freq


def test_greedy_takes_the_most_likely_token_lowest_id_on_ties():
    from training.interop.generation import Sampling, sample

    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, -1.0, 5.0, 5.0]])
    picks = sample(logits, Sampling(greedy=True, temperature=5.0, top_k=1, top_p=0.1), torch.Generator())
    assert picks.tolist() == [1, 2]
    assert (_frequencies(PROBS, temperature=1e-3) == torch.eye(6, dtype=torch.float64)[1]).all()  # T -> 0: greedy
