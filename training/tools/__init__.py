"""The back ends of the command-line tools in tools/: the memory estimate (plan, preflight), the benchmark
(bench), Hugging Face interop (convert_hf). preflight runs inside training too, before the model is built."""
