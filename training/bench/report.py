"""The text report of one tools/bench.py result (training.bench.runner.measure's dict): the run, our step's
time, throughput, MFU and memory, and, when there is one, the comparison with Megatron-Core's GPTModel,
transformers' Llama, or transformers' and torchtitan's, and the step breakdowns. A warning line when the CPU
was loaded before the run.
"""

from __future__ import annotations

import os
import statistics


def report(result: dict) -> str:
    """The text form of a bench result (tools/bench.py without --json)."""
    r = result
    lines = [f"{r['model']} | {r['config']} | {r['precision']} | vocab {r['vocab']} (padded {r['padded_vocab']}) | "
             f"{r['device']} x{r['world']}, {r['threads']} threads | load {r['load_avg_1m'][0]:.2f} -> "
             f"{r['load_avg_1m'][1]:.2f}",
             f"ours : {1e3 * r['ours_s']:.1f} ms/step | {r['tokens_per_s']:,.0f} tok/s | "
             f"{r['tflops_per_device']:.3f} TFLOP/s/dev | MFU "
             f"{'-' if r['mfu'] is None else format(r['mfu'], '.1%')} | mem {r['mem_gb']:.2f} GB"
             + ("" if r["device"].startswith("cpu") else f" (estimate {r['estimate_gb']:.2f} GB)")]  # CPU: RSS
    if "mcore_s" in r:
        lines.append(f"mcore: {1e3 * r['mcore_s']:.1f} ms/step | {r['mcore_tokens_per_s']:,.0f} tok/s | "
                     f"{r['mcore_tflops_per_device']:.3f} TFLOP/s/dev")
        q = statistics.quantiles(r["window_ratios"], n=4) if len(r["window_ratios"]) > 1 else [r["ratio"]] * 3
        lines.append(f"ratio ours/mcore {r['ratio']:.3f} (median of {len(r['window_ratios'])} paired windows of "
                     f"{r['steps']} step(s); quartiles {q[0]:.3f}-{q[2]:.3f}; fastest/fastest {r['ratio_min']:.3f})")
        lines.append(f"loss on the batch: ours {r['loss_ours']:.6f}, mcore {r['loss_mcore']:.6f} "
                     f"(rel diff {r['loss_rel_diff']:.1e})")
    if "hf_s" in r and "titan_s" not in r:
        q = statistics.quantiles(r["window_ratios"], n=4) if len(r["window_ratios"]) > 1 else [r["ratio"]] * 3
        lines.append(f"hf   : {1e3 * r['hf_s']:.1f} ms/step (transformers LlamaForCausalLM, SDPA, torch AdamW)")
        lines.append(f"ratio ours/hf {r['ratio']:.3f} (median of {len(r['window_ratios'])} paired windows of "
                     f"{r['steps']} step(s); quartiles {q[0]:.3f}-{q[2]:.3f}; fastest/fastest {r['ratio_min']:.3f})")
        lines.append(f"loss on the batch: ours {r['loss_ours']:.6f}, hf {r['loss_hf']:.6f} "
                     f"(rel diff {r['loss_rel_diff']:.1e})")
    if "titan_s" in r:
        lines += _plain_lines(r)
    if "dpo_live_s" in r:  # --preference (training/bench/bench_post.py); ours: the token (SFT) step
        peak = r["peak_gb"]
        lines.append(f"preference, {r['pairs_per_step']} pairs a step: sft {1e3 * r['sft_s']:.1f} ms | dpo stored "
                     f"{1e3 * r['dpo_stored_s']:.1f} ms ({r['dpo_stored_over_sft']:.3f}x) | dpo live "
                     f"{1e3 * r['dpo_live_s']:.1f} ms ({r['dpo_live_over_sft']:.3f}x) (medians of rotated windows)")
        lines.append(f"live reference: {r['reference_gb_built']:.4f} GB built, {r['reference_gb_estimate']:.4f} GB "
                     f"estimated" + ("" if peak["sft"] is None else " | peak GB: " + ", ".join(
                         f"{k} {v:.2f}" for k, v in peak.items())))
    if "activation_bytes" in r:  # --detail
        lines.append(f"per rank: state {r['state_bytes'] / 1e6:.2f} MB; activations per micro-batch "
                     f"{r['activation_bytes'] / 1e6:.2f} MB (estimate {r['activation_estimate_bytes'] / 1e6:.2f} MB"
                     + (", with the s x s tensors of torch's CPU math attention, which dropout > 0 selects: "
                        "tools/plan.py's estimate assumes flash attention" if r["cpu_math_attention"] else "")
                     + f"); collectives {r['comm_share']:.1%} of the step")
    if "breakdown" in r:
        b = r["breakdown"]
        shares = ", ".join(f"{k[:-6]} {v:.1%}" for k, v in b.items() if k.endswith("_share"))
        lines.append(f"breakdown of a {1e3 * b['step_s']:.1f} ms step: {shares}")
    for name in ("hf", "titan"):
        if f"{name}_breakdown" in r:
            b = r[f"{name}_breakdown"]
            shares = ", ".join(f"{k[:-6]} {v:.1%}" for k, v in b.items() if k.endswith("_share"))
            lines.append(f"{name} breakdown of a {1e3 * b['step_s']:.1f} ms step: {shares}")
    if r["device"].startswith("cpu") and r["load_avg_1m"][0] > os.cpu_count():  # before our own steps
        lines.append(f"warning: load average {r['load_avg_1m'][0]:.1f} on {os.cpu_count()} cores before the run: "
                     f"other processes compete for the CPU and these timings are noisy")
    return "\n".join(lines)


PLAIN = {"hf": "transformers LlamaForCausalLM", "titan": "torchtitan 0.3.0 Llama3Model"}


def _plain_lines(r: dict) -> list[str]:
    """--compare: each plain PyTorch side's step time, ratio (median of rotated windows) and loss."""
    lines = [f"{name:<5}: {1e3 * r[f'{name}_s']:.1f} ms/step ({what}, SDPA, torch AdamW)"
             for name, what in PLAIN.items()]
    for name in PLAIN:
        ratios = r[f"window_ratios_{name}"]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [r[f"ratio_{name}"]] * 3
        lines.append(f"ratio ours/{name} {r[f'ratio_{name}']:.3f} (median of {len(ratios)} rotated windows of "
                     f"{r['steps']} step(s); quartiles {q[0]:.3f}-{q[2]:.3f}; fastest/fastest "
                     f"{r[f'ratio_min_{name}']:.3f})")
    lines.append(f"loss on the batch: ours {r['loss_ours']:.6f}, " + ", ".join(
        f"{name} {r[f'loss_{name}']:.6f} (rel diff {r[f'loss_rel_diff_{name}']:.1e})" for name in PLAIN))
    return lines
