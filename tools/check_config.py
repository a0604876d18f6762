"""Validate a config for WORLD_SIZE processes, and the files it names, before launching any (the launch scripts
call this).

    WORLD_SIZE=4 python tools/check_config.py parallel.tp=2 parallel.pp=2
    python tools/check_config.py --nproc 4 parallel.tp=2 parallel.pp=2   # the same
    python tools/check_config.py --port 29500 ...   # also check the rendezvous port is free

Prints one summary line and exits 0, or one line per problem (`error: ...`) and exits 2.
"""

import argparse
import os
import sys

from training.errors import exit_on_error
from training.shims.noise import quiet_known_noise


def check(argv: list[str]) -> None:
    from training.config.compose import compose
    from training.config.paths import check_paths
    from training.config.validate import validate
    from training.errors import LaunchError
    from training.parallel.spawn import port_problem
    from training.shims.cpu_compat import check_mcore_version

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                     epilog="The other arguments are Hydra overrides (key=value).")
    parser.add_argument("--nproc", type=int, default=int(os.environ.get("WORLD_SIZE", "1")),
                        help="processes in the job (default: $WORLD_SIZE, else 1)")
    parser.add_argument("--port", type=int, default=None, help="rendezvous port that must be free")
    args, overrides = parser.parse_known_args(argv)
    if flags := [a for a in overrides if a.startswith("-")]:
        raise LaunchError(f"unknown option {flags[0]}: tools/check_config.py takes --nproc and --port; the other "
                          f"arguments are Hydra overrides (key=value)")
    quiet_known_noise()
    check_mcore_version()
    cfg = compose(overrides)
    layout = validate(cfg, args.nproc)
    check_paths(cfg)  # the files it names: data.paths, data.tokenizer, checkpoint.load
    if args.port is not None and (problem := port_problem(args.port)):
        raise LaunchError(problem)
    print(f"config ok: {layout.describe()}")


def main(argv: list[str]) -> int:
    """check(argv), with the user's errors as one line each and exit code 2."""
    return exit_on_error(check, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
