"""Memory and speed of tools/convert_hf.py on a checkpoint of a real model's layer shape: peak resident memory
(the whole process, Python and libraries included: the kernel's max RSS of the child) of import, export and
export --check, against the bound 1 GiB + the largest safetensors shard + 2 x the largest tensor at fp32, and
the bytes/s of each. The round trip is checked bit for bit (bf16 in, bf16 out).

    .venv/bin/python tools/bench_convert.py                                  # Llama-3.1-8B's shape, 2 layers, 1 GiB shards
    .venv/bin/python tools/bench_convert.py --preset qwen3_8b --layers 4 --shard-gb 2 --dir /scratch/bench --json
    .venv/bin/python tools/bench_convert.py --preset llama3_2_1b --layers 16 --export-shard-gb 5  # one output file

The checkpoint is written by this script tensor by tensor (random bf16, the names and shapes of transformers'
model for the preset, built on the meta device), so making it needs no more memory than converting it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_checkpoint(preset: str, layers: int, shard_gb: float, out: Path) -> dict:
    """A random bf16 Hugging Face checkpoint of `preset`'s shape with `layers` layers in shards of shard_gb;
    returns its facts (bytes, largest shard, largest tensor's elements, parameters)."""
    import torch
    import transformers

    from models.shape import ModelShape
    from training.config.compose import compose
    from training.interop import hf, hf_config
    from training.interop.hf_check import params_on_meta

    cfg = compose([f"model={preset}", f"model.num_layers={layers}"])
    config = hf_config.hf_config(ModelShape.of(cfg.model), cfg.model, "bf16")
    with params_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(0)

    def tensors():
        for name, param in model.named_parameters():
            tensor = torch.empty(param.shape, dtype=torch.bfloat16)
            if name.endswith("norm.weight"):
                tensor.fill_(1.0)
            else:
                tensor.normal_(0.0, 0.02, generator=generator)
            yield name, tensor

    out.mkdir(parents=True)
    size = hf.write_safetensors(tensors(), out, int(shard_gb * 2**30))
    config.save_pretrained(str(out))
    shards = [f.stat().st_size for f in out.glob("*.safetensors")]
    largest = max(p.numel() for p in model.parameters())
    return {"bytes": size, "shards": len(shards), "largest_shard": max(shards), "largest_tensor": largest,
            "parameters": sum(p.numel() for p in model.parameters())}


def measured(argv: list[str]) -> tuple[float, int, str]:
    """Run tools/convert_hf.py argv in a child: (seconds, its peak resident memory in bytes, its output's last
    line). The peak is the child's own VmHWM, printed at its exit (--run): the kernel's ru_maxrss of a child
    also counts the parent's pages it shared between fork and exec."""
    start = time.perf_counter()
    child = subprocess.run([sys.executable, __file__, "--run", *argv], cwd=ROOT, capture_output=True, text=True)
    output = (child.stdout + child.stderr).strip()
    if child.returncode:
        sys.exit(f"error: convert_hf.py {' '.join(argv)} exited {child.returncode}:\n{output[-3000:]}")
    peak = int(child.stderr.strip().splitlines()[-1].removeprefix(PEAK))
    return time.perf_counter() - start, peak, child.stdout.strip().splitlines()[-1]


PEAK = "peak resident memory (bytes): "


def run_measured(argv: list[str]) -> None:
    """--run: tools/convert_hf.py argv in this process, then its peak resident memory (VmHWM) on stderr."""
    import atexit
    import runpy

    def report():
        kib = next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM"))
        sys.stderr.write(f"\n{PEAK}{int(kib) * 1024}\n")

    atexit.register(report)
    sys.argv = [str(ROOT / "tools" / "convert_hf.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


def same_tensors(a: Path, b: Path) -> int:
    """Compare two HF directories' tensors one at a time (names, dtypes, bits); returns how many."""
    import torch

    from training.interop.hf import HFWeights

    left, right = HFWeights(a), HFWeights(b)
    if sorted(left.where) != sorted(right.where):
        sys.exit(f"error: the export's tensor names differ: {sorted(set(left.where) ^ set(right.where))[:6]}")
    for name in sorted(left.where):
        x, y = left(name), right(name)
        if x.dtype != y.dtype or not torch.equal(x, y):
            sys.exit(f"error: {name} differs after the round trip ({x.dtype} -> {y.dtype})")
    return len(left.where)


def main() -> int:
    if sys.argv[1:2] == ["--run"]:
        return run_measured(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama3_1_8b", help="the layer shape (a conf/model preset)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--shard-gb", type=float, default=1.0, help="safetensors shard size (in, and out unless "
                                                                    "--export-shard-gb)")
    parser.add_argument("--export-shard-gb", type=float, help="the export's --max-shard-gb (5: convert_hf's default, "
                                                              "one file for a model under 5 GB)")
    parser.add_argument("--dir", default="outputs/bench_convert", help="scratch directory (removed first)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out_gb = str(args.export_shard_gb or args.shard_gb)
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    facts = make_checkpoint(args.preset, args.layers, args.shard_gb, work / "hf")
    bound = 2**30 + facts["largest_shard"] + 2 * 4 * facts["largest_tensor"]
    steps = {
        "import": ["import", "--hf-dir", str(work / "hf"), "--out", str(work / "ckpt"), "--preset-out",
                   str(work / "preset.yaml")],
        "export": ["export", "--ckpt", str(work / "ckpt"), "--out", str(work / "export"),
                   "--max-shard-gb", out_gb],
        "export --check": ["export", "--ckpt", str(work / "ckpt"), "--out", str(work / "export_check"),
                           "--max-shard-gb", out_gb, "--check"],
    }
    rows = {}
    for step, argv in steps.items():
        seconds, rss, last = measured(argv)
        rows[step] = {"seconds": round(seconds, 1), "max_rss_gb": round(rss / 2**30, 3),
                      "gb_per_s": round(facts["bytes"] / 2**30 / seconds, 3), "under_bound": rss < bound,
                      "last_line": last}
    tensors = same_tensors(work / "hf", work / "export")
    result = {"preset": args.preset, "layers": args.layers, "parameters": facts["parameters"],
              "checkpoint_gb": round(facts["bytes"] / 2**30, 3), "shards": facts["shards"],
              "largest_shard_gb": round(facts["largest_shard"] / 2**30, 3),
              "largest_tensor_fp32_gb": round(4 * facts["largest_tensor"] / 2**30, 3),
              "bound_gb": round(bound / 2**30, 3), "round_trip_identical_tensors": tensors, "steps": rows}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{args.preset} x {args.layers} layers: {facts['parameters'] / 1e9:.2f} B parameters, "
              f"{result['checkpoint_gb']} GiB bf16 in {facts['shards']} shards (largest {result['largest_shard_gb']} "
              f"GiB); largest tensor at fp32 {result['largest_tensor_fp32_gb']} GiB; bound {result['bound_gb']} GiB")
        for step, row in rows.items():
            print(f"  {step:15s} {row['seconds']:7.1f} s  max RSS {row['max_rss_gb']:6.3f} GiB  "
                  f"({row['max_rss_gb'] / result['checkpoint_gb']:.2f} x the checkpoint)  {row['gb_per_s']} GiB/s  "
                  f"{'under' if row['under_bound'] else 'OVER'} the bound")
        print(f"  round trip: {tensors} tensors bit-identical (bf16)")
    return 0 if all(r["under_bound"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
