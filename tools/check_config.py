"""Validate a config for WORLD_SIZE processes before launching any (the launch scripts call this).

    WORLD_SIZE=4 python tools/check_config.py parallel.tp=2 parallel.pp=2
    python tools/check_config.py --port 29500 ...   # also check the rendezvous port is free

Prints one summary line and exits 0, or one line per problem (`error: ...`) and exits 2.
"""

import argparse
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.errors import TemplateError  # noqa: E402


def port_problem(port: int) -> str | None:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError as err:
            return (f"MASTER_PORT={port} is not free on this host ({err.strerror}): "
                    f"pick another with MASTER_PORT=... or leave it unset for a free one")
    return None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=None, help="rendezvous port that must be free")
    args, overrides = parser.parse_known_args(argv)
    try:
        from training.compose import compose
        from training.cpu_compat import check_mcore_version
        from training.validate import validate

        check_mcore_version()
        cfg = compose(overrides)
        derived = validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    except TemplateError as err:
        print("\n".join(f"error: {line}" for line in str(err).splitlines()), file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - Hydra's override/composition errors, made one line
        print(f"error: {type(err).__name__}: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    if args.port is not None and (problem := port_problem(args.port)):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    print(f"config ok: {derived.describe(cfg)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
