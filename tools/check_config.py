"""Validate a config for WORLD_SIZE processes, and the files it names, before launching any (the launch scripts
call this).

    WORLD_SIZE=4 .venv/bin/python tools/check_config.py parallel.tp=2 parallel.pp=2
    .venv/bin/python tools/check_config.py --nproc 4 parallel.tp=2 parallel.pp=2   # the same
    .venv/bin/python tools/check_config.py --port 29500 ...   # also check the rendezvous port is free
    .venv/bin/python tools/check_config.py --run-dir outputs/run1 ...   # checkpoint.load=auto: that run's checkpoints

The files: data.paths (and the format their PREFIX.json records against data.format), data.tokenizer, and the
checkpoint the run would load (checkpoint.load, or with auto the run dir's newest: --run-dir, else a
hydra.run.dir=... override): its run.json's tokenizer and model against the config's, every differing field in
one line (training/config/checkpoint_match.py: the rules the ranks apply when they load it).
Prints one summary line and exits 0, or one line per problem (`error: ...`) and exits 2.
"""

import argparse
import os
import sys

from training.errors import exit_on_error
from training.shims.noise import quiet_known_noise


def check(argv: list[str]) -> None:
    from training.config import optim_defaults
    from training.config.compose import compose
    from training.config.paths import check_paths
    from training.config.validate import notes, validate
    from training.errors import ConfigError, LaunchError
    from training.parallel.spawn import port_problem
    from training.shims.cpu_compat import check_mcore_version

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                     epilog="The other arguments are Hydra overrides (key=value).")
    parser.add_argument("--nproc", type=int, default=int(os.environ.get("WORLD_SIZE", "1")),
                        help="processes in the job (default: $WORLD_SIZE, else 1)")
    parser.add_argument("--port", type=int, default=None, help="rendezvous port that must be free")
    parser.add_argument("--run-dir", default=None, help="the run's directory (default: a hydra.run.dir=... "
                        "override): checkpoint.load=auto loads its newest checkpoint")
    args, overrides = parser.parse_known_args(argv)
    if flags := [a for a in overrides if a.startswith("-")]:
        from training.config.aliases import alias, exact

        hint = exact(flags[0]) or alias(flags[0])
        raise LaunchError(f"unknown option {flags[0]}: tools/check_config.py takes --nproc, --port and --run-dir; "
                          f"the other arguments are Hydra overrides (key=value)" + (f"; {hint}" if hint else ""))
    quiet_known_noise()
    check_mcore_version()
    cfg = compose(overrides)
    layout = validate(cfg, args.nproc)
    check_paths(cfg)  # the files it names: data.paths, data.tokenizer, checkpoint.load
    run_dir = args.run_dir or next((a.split("=", 1)[1] for a in reversed(overrides)
                                    if a.lstrip("+").startswith("hydra.run.dir=")), None)
    if found := checkpoint_problems(cfg, run_dir):
        raise ConfigError("\n".join(found))
    if args.port is not None and (problem := port_problem(args.port)):
        raise LaunchError(problem)
    for note in notes(cfg):
        print(note)
    print(f"config ok: {layout.describe()}; {optim_defaults.describe(cfg)}")


def checkpoint_problems(cfg, run_dir: str | None) -> list[str]:
    """The checkpoint the run would load against the config, one line per problem (the ranks' rules:
    training/config/checkpoint_match.py). A relative checkpoint.dir lies in the run dir (training/engine/entry.py):
    without one known, auto finds nothing here."""
    import json

    from models.shape import ModelShape
    from training.config.checkpoint_match import load_target, loadable, match_problems
    from training.config.paths import RUN_FILE
    from training.data.datasets import resolve_vocab_size
    from training.data.tokenizer import build_tokenizer

    if cfg.checkpoint.dir is not None and not os.path.isabs(cfg.checkpoint.dir):
        cfg.checkpoint.dir = os.path.join(run_dir, cfg.checkpoint.dir) if run_dir else None
    target, weights_only = load_target(cfg)
    if (path := loadable(target)) is None:
        return []  # from scratch, or check_paths / the load itself says why it cannot load
    try:
        run = json.loads((path / RUN_FILE).read_text())
    except (OSError, ValueError):
        return []  # the ranks' load names the file and an earlier checkpoint (checkpoint/common.py read_run)
    if not isinstance(run, dict) or "model" not in run.get("config", {}) or "vocab_size" not in run:
        return []  # not one of ours: the load says so
    shape = ModelShape.of(cfg.model, resolve_vocab_size(cfg, build_tokenizer(cfg.data.tokenizer)))
    return match_problems(run, cfg, shape, path, weights_only, build_tokenizer)


def main(argv: list[str]) -> int:
    """check(argv), with the user's errors as one line each and exit code 2."""
    return exit_on_error(check, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
