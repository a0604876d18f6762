#!/usr/bin/env bash
# Print the path of a Python >= 3.12 interpreter (python3.12, a pyenv 3.12.x, or python3), or nothing.
set -u
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
for candidate in python3.12 python3.13 \
    "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 \
    "$HOME"/.pyenv/versions/3.12*/bin/python3.12 python3; do
  if ok "$candidate"; then command -v "$candidate" || echo "$candidate"; exit 0; fi
done
exit 1
