"""conf/model's Gemma 2 / 3, OLMo 2, Phi-4, Mistral and gpt-oss presets are the published models: importing the published
config.json (training/interop/hf_config.py model_fields) gives the preset's shape, sequence length aside (the presets
train shorter), and the planner's parameter count equals transformers' model built from that config.json on the
meta device. (Llama 3.x and Qwen: tests/test_hf_families.py.)

The config.json fields that set the shape, as the Hugging Face Hub publishes them (where each was read: the
preset's `# source:` line). Gemma 3 4B / 12B / 27B are multimodal checkpoints whose text_config lists only what
differs from transformers' Gemma3TextConfig defaults; GEMMA3_TEXT writes those defaults out (checked below against
transformers' own).
"""

import importlib.util

import pytest
from hf_interop import meta_parameter_count

if importlib.util.find_spec("transformers") is None:
    pytest.skip("needs the hf extra: pip install -e '.[hf]'", allow_module_level=True)

GEMMA3_TEXT = dict(model_type="gemma3_text", vocab_size=262208, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=256, max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1e6,
                   rope_local_base_freq=1e4, query_pre_attn_scalar=256, sliding_window_pattern=6,
                   hidden_activation="gelu_pytorch_tanh")
LINEAR_8 = {"factor": 8.0, "rope_type": "linear"}
GEMMA2 = dict(model_type="gemma2", vocab_size=256000, max_position_embeddings=8192, rms_norm_eps=1e-6,
              rope_theta=10000.0, sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
              hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh", attention_bias=False)
OLMO2 = dict(model_type="olmo2", vocab_size=100352, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=500000,
             rope_scaling=None, attention_bias=False, tie_word_embeddings=False, hidden_act="silu")
PHI4_MINI_LONG = [1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649,
                  2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845,
                  5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129,
                  13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418,
                  28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28,
                  33.49, 33.5, 44.16, 47.77]
GPT_OSS = dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, head_dim=64, num_attention_heads=64,
               num_key_value_heads=8, num_experts_per_tok=4, vocab_size=201088, max_position_embeddings=131072,
               initial_context_length=4096, rms_norm_eps=1e-5, rope_theta=150000, sliding_window=128,
               rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                             "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
               swiglu_limit=7.0, attention_bias=True, router_aux_loss_coef=0.9, tie_word_embeddings=False,
               hidden_act="silu", quantization_config={"quant_method": "mxfp4"})
PUBLISHED = {
    "gemma3_1b": dict(GEMMA3_TEXT, vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=32768, sliding_window=512,
                      rope_scaling=None),
    "gemma3_4b": dict(GEMMA3_TEXT, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                      rope_scaling=LINEAR_8, sliding_window=1024),
    "gemma3_12b": dict(GEMMA3_TEXT, hidden_size=3840, intermediate_size=15360, num_attention_heads=16,
                       num_hidden_layers=48, num_key_value_heads=8, rope_scaling=LINEAR_8, sliding_window=1024),
    "gemma3_27b": dict(GEMMA3_TEXT, head_dim=128, hidden_size=5376, intermediate_size=21504, num_attention_heads=32,
                       num_hidden_layers=62, num_key_value_heads=16, query_pre_attn_scalar=168, rope_scaling=LINEAR_8,
                       sliding_window=1024),
    "gemma2_2b": dict(GEMMA2, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256),
    "gemma2_9b": dict(GEMMA2, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256),
    "gemma2_27b": dict(GEMMA2, hidden_size=4608, intermediate_size=36864, num_hidden_layers=46, num_attention_heads=32,
                       num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=144),
    "olmo2_7b": dict(OLMO2, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32),
    "olmo2_13b": dict(OLMO2, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=40),
    "phi4": dict(model_type="phi3", hidden_size=5120, intermediate_size=17920, num_hidden_layers=40,
                 num_attention_heads=40, num_key_value_heads=10, vocab_size=100352, max_position_embeddings=16384,
                 original_max_position_embeddings=16384, rms_norm_eps=1e-5, rope_theta=250000, rope_scaling=None,
                 sliding_window=None, tie_word_embeddings=False, hidden_act="silu", attention_bias=False),
    "phi4_mini": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                      num_attention_heads=24, num_key_value_heads=8, vocab_size=200064, max_position_embeddings=131072,
                      original_max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                      partial_rotary_factor=0.75, sliding_window=262144, tie_word_embeddings=True, hidden_act="silu",
                      rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": PHI4_MINI_LONG},
                      attention_bias=False),
    "mistral_7b_v0_1": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                            max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096,
                            tie_word_embeddings=False, hidden_act="silu"),
    "gpt_oss_20b": dict(GPT_OSS, num_hidden_layers=24, num_local_experts=32,
                        layer_types=["sliding_attention", "full_attention"] * 12),
    "gpt_oss_120b": dict(GPT_OSS, num_hidden_layers=36, num_local_experts=128,
                         layer_types=["sliding_attention", "full_attention"] * 18),
}
CONFIG_CLASSES = {"gemma3_text": "Gemma3TextConfig", "gemma2": "Gemma2Config", "olmo2": "Olmo2Config",
                  "phi3": "Phi3Config", "mistral": "MistralConfig", "gpt_oss": "GptOssConfig"}
# the published parameter counts, rounded as the model cards and papers give them
ROUNDED = {"gemma2_2b": 2.61, "gemma2_9b": 9.24, "gemma2_27b": 27.23, "gemma3_27b": 27.01, "olmo2_13b": 13.72,
           "phi4": 14.66, "phi4_mini": 3.84, "mistral_7b_v0_1": 7.24, "gpt_oss_20b": 20.91, "gpt_oss_120b": 116.83}


def _imported(preset: str, published: dict):
    """The preset's config with every field an import of `published` sets (seq_length kept)."""
    from training.config.compose import compose
    from training.interop.hf_config import model_fields

    config = compose([f"model={preset}"]).model
    seq_length, fields = config.seq_length, model_fields(published)
    for group in ("moe", "rope_scaling"):
        for key, value in fields.pop(group, {}).items():
            setattr(getattr(config, group), key, value)
    if (fields["sliding_window"] or 0) >= published["max_position_embeddings"]:  # Phi-4-mini's 262144: a window
        fields.update(sliding_window=None, layer_types=None)  # past every position is no window (no band mask)
    for key, value in fields.items():
        setattr(config, key, value)
    config.seq_length = seq_length
    return config


@pytest.mark.fast
def test_dense_presets_are_the_published_models():
    import transformers

    from models.gpt import active_params, num_params
    from models.shape import ModelShape
    from training.config.compose import compose

    counts = {}
    for preset, published in PUBLISHED.items():
        ours = compose([f"model={preset}"]).model
        assert ModelShape.of(_imported(preset, published)) == ModelShape.of(ours), preset
        assert ours.max_position_embeddings == published["max_position_embeddings"], preset  # what export writes
        counts[preset] = meta_parameter_count(CONFIG_CLASSES[published["model_type"]], published)
        assert num_params(ModelShape.of(ours)) == counts[preset], (preset, counts[preset])
    assert {name: round(counts[name] / 1e9, 2) for name in ROUNDED} == ROUNDED, counts
    # gpt-oss's active parameters a token (its model card: 3.6 B / 5.1 B): transformers' model less the input
    # embedding and the routed experts' (E - k) / E share, against models/gpt.py's active_params
    for preset, published in {"gpt_oss_20b": 3.61, "gpt_oss_120b": 5.13}.items():
        shape = ModelShape.of(compose([f"model={preset}"]).model)
        assert active_params(shape) == _hf_active(PUBLISHED[preset]) and round(active_params(shape) / 1e9, 2) == published
    defaults = transformers.Gemma3TextConfig().to_dict()  # what Gemma 3's sparse text_config leaves to them
    for key in ("vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                "rms_norm_eps", "query_pre_attn_scalar", "hidden_activation"):
        assert defaults[key] == GEMMA3_TEXT[key], key
    assert defaults["rope_parameters"]["full_attention"]["rope_theta"] == GEMMA3_TEXT["rope_theta"]
    assert defaults["rope_parameters"]["sliding_attention"]["rope_theta"] == GEMMA3_TEXT["rope_local_base_freq"]


def _hf_active(published: dict) -> int:
    """A gpt-oss's active parameters from transformers' model on the meta device."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**published))
    params = dict(model.named_parameters())
    experts = sum(p.numel() for n, p in params.items() if ".mlp.experts." in n)
    idle = experts * (published["num_local_experts"] - published["num_experts_per_tok"]) // published["num_local_experts"]
    return sum(p.numel() for p in params.values()) - idle - params["model.embed_tokens.weight"].numel()
