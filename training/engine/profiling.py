"""train.profile: a torch.profiler trace of iterations [profile_start, profile_end) written to
<run dir>/profile/ (open it in Perfetto or TensorBoard). Rank 0 only: one trace is enough to read and
traces from every rank of a large job would be gigabytes."""

from __future__ import annotations

from pathlib import Path

import torch

from training.config.schema import Config


class Profiler:
    def __init__(self, cfg: Config, run_dir: str | Path, enabled: bool):
        t = cfg.train
        self.enabled = t.profile and enabled
        self.start, self.end = t.profile_start, t.profile_end
        self.out = Path(run_dir) / "profile"
        self.active = None

    def step(self, iteration: int) -> None:
        """Call before each iteration: starts and stops the window."""
        if not self.enabled:
            return
        if iteration == self.start and self.active is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.active = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=False)
            self.active.__enter__()
        elif iteration == self.end:
            self.close()

    def close(self) -> None:
        if self.active is not None:
            self.active.__exit__(None, None, None)
            self.out.mkdir(parents=True, exist_ok=True)
            path = self.out / f"trace_iters_{self.start}_{self.end}.json"
            self.active.export_chrome_trace(str(path))
            print(f"profiler: wrote {path}", flush=True)
            self.active = None
