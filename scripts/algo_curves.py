"""Draw docs/algorithms.md's picture and table from groups of run folders.

    python scripts/algo_curves.py OUT.png NAME=RUN_DIR,RUN_DIR,... [NAME=...]

The first group is the reference of the "vs" column (e.g. sync).
"""

from __future__ import annotations

import sys

from asyncflow.errors import UserError
from asyncflow.telemetry.compare import compare


def main(argv: list[str]) -> int:
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        print("usage: algo_curves.py OUT.png NAME=RUN_DIR,RUN_DIR,... [NAME=...]", file=sys.stderr)
        return 2
    groups = {name: paths.split(",") for name, paths in (a.split("=", 1) for a in argv[1:])}
    try:
        print(compare(groups, argv[0], title="arith: eval accuracy vs trained samples"), end="")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
