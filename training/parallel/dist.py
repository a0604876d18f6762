"""Distributed start and teardown: torchrun env -> process group -> Megatron-Core parallel state -> seeds.

NCCL when CUDA is available (device bound to LOCAL_RANK), gloo otherwise (and then training.shims.cpu_compat
makes Megatron-Core run on the CPU). `distributed(...)` is a context manager that always tears down:
on success every rank meets at a barrier first; on an error the failing rank leaves without a barrier,
so the peers' next collective fails promptly instead of waiting for the collective timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from training.errors import LaunchError
from training.parallel.layout import Layout
from training.parallel.spawn import free_port
from training.shims import cpu_compat
from training.shims.noise import quiet_known_noise


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    device: torch.device
    layout: Layout  # the sizes (training/parallel/layout.py); dp, edp derived there

    world_size = property(lambda self: self.layout.world)
    tp = property(lambda self: self.layout.tp)
    pp = property(lambda self: self.layout.pp)
    dp = property(lambda self: self.layout.dp)
    cp = property(lambda self: self.layout.cp)


def single_process_env() -> None:
    """A world of one on a free local port, unless torchrun (or a launcher) already set RANK / WORLD_SIZE:
    `python train.py` and the tools then need no torchrun."""
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))


def env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise LaunchError(f"environment variable {name} is not set: start with torchrun or launch/train.sh")
        return default
    return int(value)


def select_device(local_rank: int) -> torch.device:
    """The device this rank computes on; installs the CPU patches when there is no GPU."""
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise LaunchError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are visible: "
                f"start at most {torch.cuda.device_count()} processes per node (NPROC)"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    cpu_compat.apply()
    return torch.device("cpu")


def check_layout(layout: Layout) -> Layout:
    """The layout, or a LaunchError naming its first broken rule (the world the launcher started does not
    fit the sizes: validation checked the config against WORLD_SIZE already, tests and tools may not have)."""
    if found := layout.problems():
        raise LaunchError(found[0])
    return layout


def set_seeds(seed: int) -> None:
    """Megatron-LM's scheme: one seed per pipeline stage, shared by its TP and DP ranks; TP-distinct
    streams for dropout on sharded activations live in Megatron-Core's RNG tracker."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store at MASTER_ADDR:MASTER_PORT, its keys prefixed with torchrun's restart count.

    After a restart (launch/train.sh MAX_RESTARTS) torchrun hands the new ranks the same store; without the
    prefix a rank can read a dead predecessor's gloo / NCCL address and wait on it (measured: gloo's
    connectFullMesh "Connection refused" on a restart, with torchrun's static and standalone rendezvous
    alike). Under torchrun the elastic agent serves the store; otherwise rank 0 does. The same holds for a
    process that starts a second process group after tearing down its first (tests, tools running several
    jobs): every start in a process gets its own prefix too. A world of one outside torchrun keeps its store in
    memory (a port picked free can be taken before it is bound: EADDRINUSE under load)."""
    global _starts
    _starts += 1
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if world_size == 1 and not agent:  # one process (the tools, python train.py): no port to listen on or lose
        store = dist.HashStore()
    else:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], env_int("MASTER_PORT"), world_size,
                              is_master=rank == 0 and not agent, timeout=timeout, multi_tenant=not agent)
    return dist.PrefixStore(f"/template/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_starts}", store)


_starts = 0  # process groups this process started (attempt_store's prefix)


def init(tp: int = 1, pp: int = 1, vpp: int | None = None, seed: int = 1234,
         timeout_minutes: float = 10.0, ep: int = 1, etp: int = 1, cp: int = 1) -> DistInfo:
    """Start torch.distributed from torchrun's environment and Megatron-Core's model-parallel groups."""
    quiet_known_noise()
    rank, world_size = env_int("RANK"), env_int("WORLD_SIZE")
    local_rank = env_int("LOCAL_RANK", rank)
    layout = check_layout(Layout(world_size, tp, pp, vpp, cp, ep, etp))
    device = select_device(local_rank)
    from megatron.core import parallel_state

    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if not dist.is_initialized():
        dist.init_process_group(backend, store=attempt_store(rank, world_size, timeout), rank=rank,
                                world_size=world_size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=max(1, int(timeout_minutes)),
    )
    set_seeds(seed)
    return DistInfo(rank, local_rank, device, layout)


def teardown(clean: bool = True) -> None:
    """Destroy Megatron-Core's groups and the default group; barrier first only on a clean exit."""
    from megatron.core import parallel_state

    if dist.is_initialized() and clean:
        with contextlib.suppress(Exception):
            dist.barrier()
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def reset_model_parallel() -> None:
    """Destroy Megatron-Core's groups but keep the process group, so the same processes can set up
    another layout (tests and tools that compare layouts)."""
    from megatron.core import parallel_state

    dist.barrier()
    parallel_state.destroy_model_parallel()


def layout_of(cfg) -> dict:
    """init's arguments for a config: the layout, the seed and the collective timeout."""
    p = cfg.parallel
    return dict(tp=p.tp, pp=p.pp, vpp=p.vpp, cp=p.cp, ep=p.ep, etp=p.etp, seed=cfg.train.seed,
                timeout_minutes=p.timeout_minutes)


@contextlib.contextmanager
def distributed(**kwargs):
    """`with distributed(tp=2) as info:` ... always torn down, also when the body raises."""
    clean = False
    try:
        yield init(**kwargs)
        clean = True
    finally:
        teardown(clean=clean)


def current_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args, **kwargs) -> None:
    """print on global rank 0 only (flushes, so interleaved torchrun output stays readable)."""
    if is_rank0():
        print(*args, **kwargs, flush=True)
