"""LoRA's activation bytes (training/estimate/lora.py adapter_activations) against what the adapted layer's forward
saves for backward, measured as tests/test_activation_bytes.py measures every block (its saved_bytes: the storages
autograd saves, each once, less parameters and module state; one layer, fp32 unless bf16, torch's CPU flash kernel).

Every linear of the layer adapted (fused, or canonical: an A and a B per q, k, v / gate, up), the base frozen
(peft.freeze), with peft.dropout > 0 in most cases; at one process, and at tp2 + sp and tp2 on two processes (an SP
column adapter's input is its rank's tokens, a row adapter's h is reduce-scattered along the sequence). Two checks
a case: the whole layer (the blocks' declarations + the adapters') within 10%, and the adapters' own bytes (what
the layer saves more than the same layer without them, every weight trained) within 10%: the h terms are ~2% of a
layer, which the first check alone would not see.
"""

import pytest
import torch
from test_activation_bytes import BASE, TOLERANCE, B, S, saved_bytes

from training.config.compose import compose

LORA = ["peft=lora", "peft.rank=8", "peft.dropout=0.1"]
CANONICAL = "peft.targets=[linear_q,linear_k,linear_v,linear_proj,linear_fc1_gate,linear_fc1_up,linear_fc2]"
TP2_SP = ["parallel.tp=2", "parallel.sp=true"]
LORA_CASES = {  # name -> (overrides, processes)
    "lora-dropout": (LORA, 1), "lora-dropout-canonical": ([*LORA, CANONICAL], 1),
    "lora-dropout-selective": ([*LORA, "model.recompute=selective"], 1),
    "lora-dropout-softcap-bf16": ([*LORA, "model.attn_logit_softcap=20", "train.precision=bf16"], 1),
    "lora-tp2-sp": (["peft=lora", "peft.rank=8", *TP2_SP], 2), "lora-dropout-tp2-sp": ([*LORA, *TP2_SP], 2),
    "lora-dropout-canonical-tp2-sp": ([*LORA, CANONICAL, *TP2_SP], 2),
    "lora-dropout-tp2": ([*LORA, "parallel.tp=2"], 2),
}


def measure_lora(overrides: list[str]) -> tuple[float, float, float, float]:
    """(measured, declared) bytes of the adapted layer, then (measured, declared) of the adapters' own part: what
    the layer saves more than without them. torch's CPU dropout keeps its scaled noise in the input's dtype; on a
    GPU at::dropout runs native_dropout, which keeps a bool mask (what the estimate counts): run here too."""
    import torch.nn.functional as F
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from models.layer import TransformerLayer
    from models.rope import rotary_dim
    from models.shape import ModelShape
    from training.engine.bridge import params_dtype, transformer_config
    from training.estimate import lora
    from training.estimate.memory import activation_context, layer_activations, split_of
    from training.parallel import peft
    from training.parallel.layout import Layout

    real = F.dropout

    def native(x, p=0.5, training=True, inplace=False):
        return torch.native_dropout(x, p, True)[0] if training and 0 < p < 1 and x.numel() else real(x, p, training)

    out = []
    for adapted in (True, False):
        cfg = compose([*BASE, *(overrides if adapted else [o for o in overrides if not o.startswith("peft")])])
        shape, dtype, lay = ModelShape.of(cfg.model), params_dtype(cfg), Layout.of(cfg, cfg.parallel.tp)
        freqs = RotaryEmbedding(rotary_dim(shape), rotary_percent=1.0, rotary_base=shape.rotary_base,
                                use_cpu_initialization=True)(S)  # [s, 1, 1, hn]
        module = TransformerLayer(transformer_config(cfg, shape), shape, 1)
        peft.adapt(cfg, [module])
        peft.freeze(cfg, [module])
        tokens = S // lay.tp if lay.sp else S
        F.dropout = native
        try:
            with torch.compiler.set_stance("force_eager"):
                out.append(saved_bytes(module.to(dtype), lambda: (
                    torch.randn(tokens, B, shape.hidden_size, dtype=dtype, requires_grad=True), freqs)))
        finally:
            F.dropout = real
        if adapted:
            extra = lora.adapter_activations(cfg, shape, lay, activation_context(cfg, shape, lay, True), 0,
                                             split_of(lay))
            declared = layer_activations(cfg, shape, lay, flash_attention=True) + extra
    return out[0], declared, out[0] - out[1], extra


def _lora_at_two_ranks(cases: list[str]) -> dict:
    from training.parallel import dist as D

    with D.distributed(tp=2, timeout_minutes=2):
        return {case: measure_lora(LORA_CASES[case][0]) for case in cases}


@pytest.fixture(scope="module")
def two_ranks():
    from harness import run_distributed

    return run_distributed(_lora_at_two_ranks, 2, ([c for c, (_, n) in LORA_CASES.items() if n == 2],), timeout=300)


@pytest.mark.parametrize("case", list(LORA_CASES))
def test_lora_activation_bytes_match_what_the_forward_saves(case, request):
    overrides, processes = LORA_CASES[case]
    if processes == 1:
        request.getfixturevalue("one_process")
        ranks = [measure_lora(overrides)]
    else:
        ranks = [r[case] for r in request.getfixturevalue("two_ranks")]
    for measured, declared, adapters_measured, adapters_declared in ranks:
        assert measured > 0 and abs(declared - measured) <= TOLERANCE * measured, \
            f"{case}: declared {declared:,.0f} bytes, measured {measured:,} ({declared / measured - 1:+.1%})"
        assert adapters_measured > 0 and abs(adapters_declared - adapters_measured) <= TOLERANCE * adapters_measured, \
            f"{case}: the adapters' {adapters_declared:,.0f} bytes, measured {adapters_measured:,}"

