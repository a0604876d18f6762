"""The engine that trains models/ with Megatron-Core, grouped by role:

    the training path   config -> validate -> loop -> build -> bridge (-> models/), with data, losses,
                        checkpoint, metrics, dist, stopping, profiling
    shims/              the platform shims: cpu_compat (Megatron-Core on CPU), upstream_fixes
                        (Megatron-Core bugs, named after their reports), noise (known warnings quieted)
    tools/              the back ends of tools/*.py: memory (estimate), preflight, benchmark, hf
"""
