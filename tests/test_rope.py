"""RoPE of every scaling type (models/rope.py) against transformers, the oracle: inverse frequencies and attention
factors against ROPE_INIT_FUNCTIONS, the q and k our attention rotates (SelfAttention._rope, full and partial
rotary) against transformers' rotary embedding module + apply_rotary_pos_emb before and past the original context,
Gemma 3's local / global tables, config.json import / export of each type, and a small random Llama with linear
and with dynamic RoPE imported with logits equal to transformers' past max_position_embeddings. One process.
"""

import importlib.util
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("transformers") is None:
    pytest.skip("needs the hf extra: pip install -e '.[hf]'", allow_module_level=True)

pytestmark = pytest.mark.fast  # ~15 s, most of it importing Megatron-Core and transformers

HEAD_DIM, POSITIONS, ORIGINAL = 32, 64, 32  # max_position_embeddings; yarn / longrope / llama3's original length
SHORT, LONG = 24, 96  # forward lengths before and past both
ARCH = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, rope_theta=10000.0,
            max_position_embeddings=POSITIONS, intermediate_size=64, num_hidden_layers=2, vocab_size=101)
_pairs = torch.Generator().manual_seed(5)
FACTORS = {n: [1.0 + 3 * torch.rand(n, generator=_pairs)[i].item() for i in range(n)] for n in (16, 12)}
CASES = {  # name: (transformers' rope_parameters, partial_rotary_factor)
    "default": (dict(rope_type="default"), 1.0),
    "linear": (dict(rope_type="linear", factor=4.0), 1.0),
    "dynamic": (dict(rope_type="dynamic", factor=3.0), 1.0),
    "llama3": (dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=ORIGINAL), 1.0),
    "yarn": (dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=ORIGINAL, beta_fast=16.0,
                  beta_slow=2.0), 1.0),
    "yarn-gpt-oss": (dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=ORIGINAL, beta_fast=32.0,
                          beta_slow=1.0, truncate=False), 1.0),
    "yarn-deepseek": (dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=ORIGINAL, mscale=1.0,
                           mscale_all_dim=0.8), 1.0),
    "yarn-attention-factor": (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL,
                                   attention_factor=1.3), 1.0),
    "longrope": (dict(rope_type="longrope", short_factor=FACTORS[16], long_factor=[f * 2 for f in FACTORS[16]],
                      original_max_position_embeddings=ORIGINAL), 1.0),  # factor: 64 / 32 from the lengths
    "partial-default": (dict(rope_type="default"), 0.5),
    "partial-linear": (dict(rope_type="linear", factor=2.0), 0.5),
    "partial-yarn": (dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=ORIGINAL), 0.25),
    "partial-longrope": (dict(rope_type="longrope", short_factor=FACTORS[12], long_factor=FACTORS[12][::-1],
                              original_max_position_embeddings=ORIGINAL), 0.75),  # Phi-4-mini's share
}


def _hf_config(case: str):
    import transformers

    rope, partial = CASES[case]
    rope = {**rope, "rope_theta": ARCH["rope_theta"]}
    if rope["rope_type"] in ("default", "longrope") and (partial != 1.0 or rope["rope_type"] == "longrope"):
        # Phi-3 (default or longrope only): its default RoPE honours partial rotary; its top-level original length
        return transformers.Phi3Config(**ARCH, rope_parameters=rope, partial_rotary_factor=partial,
                                       original_max_position_embeddings=ORIGINAL, pad_token_id=0)
    # Llama's scaled types read partial_rotary_factor from rope_parameters (its default RoPE ignores it)
    return transformers.LlamaConfig(**ARCH, rope_parameters=rope, partial_rotary_factor=partial)


def _shape(hf: dict, **model):
    """Our ModelShape of an HF config.json through the importer (training/interop/hf_rope.py)."""
    from models.shape import ModelShape
    from training.config.compose import compose
    from training.interop import hf_rope

    cfg = compose([])
    fields = hf_rope.fields(hf)
    for key, value in fields.pop("rope_scaling", {}).items():
        setattr(cfg.model.rope_scaling, key, value)
    for key, value in {**fields, **model}.items():
        setattr(cfg.model, key, value)
    cfg.model.hidden_size, cfg.model.num_attention_heads, cfg.model.num_query_groups = 128, 4, 2
    cfg.model.kv_channels, cfg.model.num_layers = HEAD_DIM, len(cfg.model.layer_types or [0, 0])
    shape = ModelShape.of(cfg.model)
    assert shape.problems() == [], shape.problems()
    return shape


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][0]["rope_type"] != "default"])
def test_inverse_frequencies_and_attention_factor_equal_rope_init_functions(case):
    """Each type's inv_freq (relative, elementwise) within 1e-6 and its attention factor within 1e-12 of
    transformers' ROPE_INIT_FUNCTIONS, at init and for a forward past the original context (seq_len)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from models import rope

    config = _hf_config(case)
    shape = _shape(config.to_dict())
    kind = CASES[case][0]["rope_type"]
    for end in (None, SHORT, LONG):
        theirs, their_factor = ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=end)
        ours = rope.inv_freq(rope.rotary_dim(shape), shape.rotary_base, shape.rope_scaling, end)
        assert ours.dtype == torch.float32 and ours.shape == theirs.shape, (ours.shape, theirs.shape)
        assert ((ours - theirs).abs() / theirs.abs()).max().item() <= 1e-6, (case, end)
        assert abs(rope.attention_factor(shape.rope_scaling) - their_factor) <= 1e-12, case


def _ours_rotated(shape, length: int, q: torch.Tensor, k: torch.Tensor, kind: str = "full"):
    """q, k [b, heads, s, hn] rotated by our SelfAttention._rope with the table the GPT hands that layer kind."""
    from models import rope
    from models.attention import SelfAttention

    tables = rope.RotaryTables(shape)
    attention = SimpleNamespace(config=SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False),
                                rope_scale=tables.attention_factor(kind), _rope_cache=(None, None, None))
    freqs = rope.for_layer(tables(length), kind)  # [s, 1, 1, rd]
    to_ours = lambda t: t.permute(2, 0, 1, 3).contiguous()  # noqa: E731  [b, np, s, hn] -> [s, b, np, hn]
    q, k = SelfAttention._rope(attention, to_ours(q), to_ours(k), freqs)
    return q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3)


@pytest.mark.parametrize("case", list(CASES))
def test_rotated_q_and_k_equal_transformers_before_and_past_the_original_context(case):
    """What our attention applies (full rotary: the fast ApplyRope; partial: Megatron-Core's path, the rest of each
    head passed through) equals transformers' rotary module (a fresh one per length: dynamic and longrope pick
    their table from the forward's length) + Phi-3's apply_rotary_pos_emb, within 1e-6 of max |q|."""
    import transformers
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    config = _hf_config(case)
    module = (transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding
              if isinstance(config, transformers.Phi3Config) else transformers.models.llama.modeling_llama.
              LlamaRotaryEmbedding)
    shape = _shape(config.to_dict())
    generator = torch.Generator().manual_seed(1)
    for length in (SHORT, LONG):
        q, k = (torch.randn(2, heads, length, HEAD_DIM, generator=generator) for heads in (4, 2))
        cos, sin = module(config)(q, torch.arange(length)[None])  # [1, s, rd]
        ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)
        ours_q, ours_k = _ours_rotated(shape, length, q, k)
        assert max(_rel(ours_q, ref_q), _rel(ours_k, ref_k)) <= 1e-6, (case, length)


@pytest.mark.parametrize("scaling", [dict(rope_type="linear", factor=8.0),
                                     dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL)])
def test_gemma3_sliding_layers_take_their_own_base_and_no_scaling(scaling):
    """Gemma 3: sliding layers plain RoPE at rope_local_base_freq (10k), full layers rope_theta (1M) with the
    scaling and its attention factor; each kind equals transformers' Gemma3RotaryEmbedding(layer_type) past the
    original context, imported from the config.json transformers 5 writes (rope_parameters per layer type)."""
    import transformers
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    config = transformers.Gemma3TextConfig(**{**ARCH, "rope_theta": 1e6}, layer_types=[
        "sliding_attention", "full_attention"], rope_local_base_freq=1e4, rope_scaling=scaling, sliding_window=16)
    hf = config.to_dict()
    assert "sliding_attention" in hf["rope_parameters"]  # the nested form
    shape = _shape(hf, layer_types=["sliding", "full"], sliding_window=16)
    assert (shape.rotary_base, shape.rotary_base_local, shape.rope_scaling.type) == (1e6, 1e4, scaling["rope_type"])
    rotary = transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(config)
    generator = torch.Generator().manual_seed(2)
    q, k = (torch.randn(1, heads, LONG, HEAD_DIM, generator=generator) for heads in (4, 2))
    for ours_kind, theirs in (("sliding", "sliding_attention"), ("full", "full_attention")):
        ref_q, ref_k = apply_rotary_pos_emb(q, k, *rotary(q, torch.arange(LONG)[None], theirs))
        ours_q, ours_k = _ours_rotated(shape, LONG, q, k, ours_kind)
        assert max(_rel(ours_q, ref_q), _rel(ours_k, ref_k)) <= 1e-6, ours_kind


def test_config_json_round_trip_and_refusals():
    """Every type imports from config.json and exports to a config transformers reads back to the same fields;
    what we cannot express is refused naming the field and the value."""
    import transformers

    from training.interop import hf_config, hf_rope

    for case in CASES:
        config = _hf_config(case)
        shape = _shape(config.to_dict())
        kind = "phi3" if isinstance(config, transformers.Phi3Config) or CASES[case][1] != 1.0 else "llama"
        assert hf_rope.export_problems(shape, kind) == {}
        exported = dict(hf_rope.export_fields(shape, kind))
        rebuilt = type(config)(**{**ARCH, **exported, "pad_token_id": 0})
        assert _shape(rebuilt.to_dict()) == shape, case
    base = dict(ARCH, model_type="llama", hidden_act="silu")
    refused = {"rope_parameters.rope_type='proportional'": dict(rope_parameters=dict(rope_type="proportional")),
               "partial_rotary_factor=0.5": dict(partial_rotary_factor=0.5),  # transformers' Llama: whole heads
               "rope_parameters.sliding_attention.rope_type='linear'": dict(rope_parameters=dict(
                   full_attention=dict(rope_type="default"), sliding_attention=dict(rope_type="linear", factor=2.0)))}
    for named, change in refused.items():
        with pytest.raises(hf_config.HFError, match=named.replace("[", r"\[").replace(".", r"\.")):
            hf_config.model_fields(dict(base, **change))
    smollm = hf_config.model_fields(dict(base, rope_scaling=dict(type="linear", factor=2.0)))  # 4.x spelling
    assert smollm["rope_scaling"] == dict(type="linear", factor=2.0, original_max_position=POSITIONS)


@pytest.mark.parametrize("scaling", [dict(rope_type="linear", factor=2.0), dict(rope_type="dynamic", factor=2.0)])
def test_llama_with_scaled_rope_imports_with_transformers_logits(one_process, scaling):
    """A small random transformers Llama (SmolLM-style rope_type linear / dynamic) imported through
    hf_config.model_fields and the blocks' from_hf: logits within 1e-5 of transformers' (relative to max |logit|)
    on LONG tokens, past max_position_embeddings (dynamic: the base has grown)."""
    import transformers

    from models.gpt import GPT, from_hf
    from models.shape import ModelShape
    from training.config.compose import compose
    from training.engine.bridge import transformer_config
    from training.interop.hf_config import model_fields

    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**ARCH, rope_scaling=scaling)).eval()
    cfg = compose([])
    fields = model_fields(dict(hf_model.config.to_dict(), model_type="llama"))
    for key, value in fields.pop("rope_scaling", {}).items():
        setattr(cfg.model.rope_scaling, key, value)
    for key, value in fields.items():
        setattr(cfg.model, key, value)
    shape = ModelShape.of(cfg.model)
    gpt = GPT(transformer_config(cfg, shape), shape).eval()
    weights, params = hf_model.state_dict(), dict(gpt.named_parameters())
    with torch.no_grad():
        for name, tensor in from_hf(weights.__getitem__, gpt.config, shape):
            params[name].copy_(tensor)
    tokens = torch.randint(0, ARCH["vocab_size"], (2, LONG), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = gpt(tokens)[..., :ARCH["vocab_size"]]
        theirs = hf_model(input_ids=tokens).logits
    assert _rel(ours, theirs) <= 1e-5, _rel(ours, theirs)
    if scaling["rope_type"] != "dynamic":
        return
    # generation across the threshold: each decode step's keys rotated with that step's grown base, as transformers'
    from models.kv_cache import KVCache

    cache, prompt = KVCache(max_length=LONG, pad=torch.zeros(2, dtype=torch.long)), POSITIONS - 4
    with torch.no_grad():
        gpt(tokens[:, :prompt], cache=cache)
        past = hf_model(input_ids=tokens[:, :prompt], use_cache=True).past_key_values
        for t in range(prompt, POSITIONS + 4):
            ours = gpt(tokens[:, t:t + 1], cache=cache)[..., :ARCH["vocab_size"]]
            out = hf_model(input_ids=tokens[:, t:t + 1], past_key_values=past, use_cache=True)
            assert _rel(ours, out.logits) <= 1e-5, (t, _rel(ours, out.logits))
            past = out.past_key_values


class _CPRank:  # a context-parallel group as get_pos_emb_on_this_cp_rank reads it: rank 1 of 2
    def size(self):
        return 2

    def rank(self):
        return 1


def test_plain_and_llama3_tables_are_megatron_cores_bit_for_bit_also_sliced_for_cp(one_process):
    """The default table (and Llama 3's) is the one Megatron-Core's RotaryEmbedding gave before models/rope.py:
    torch.equal, whole and as CP rank 1 of 2's zigzag rows (chunks 1 and 2 of 4)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from models import rope

    llama3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=ORIGINAL)
    for scaling in (None, llama3):
        hf = dict(ARCH, rope_parameters=scaling or dict(rope_type="default"))
        ours = rope.RotaryTables(_shape(hf))
        theirs = RotaryEmbedding(HEAD_DIM, rotary_percent=1.0, rotary_base=ARCH["rope_theta"],
                                 use_cpu_initialization=True)
        if scaling:
            theirs.inv_freq = theirs._apply_scaling(theirs.inv_freq, factor=8.0, low_freq_factor=1.0,
                                                    high_freq_factor=4.0, original_max_position_embeddings=ORIGINAL)
        assert torch.equal(ours(LONG), theirs(LONG))
        ours = rope.RotaryTables(_shape(hf))
        ours.cp_group = _CPRank()  # what it reads from parallel_state under parallel.cp=2
        sliced = ours(LONG)  # [LONG / 2, 1, 1, hn]
        assert torch.equal(sliced, theirs(LONG, cp_group=_CPRank()))
        whole = theirs(LONG)
        assert torch.equal(sliced, torch.cat([whole[LONG // 4:LONG // 2], whole[LONG // 2:3 * LONG // 4]]))
