"""Rebuild the base models shipped inside the package (asyncflow/tasks/base_models/).

    python scripts/build_base_models.py [TASK ...]      # default: every shipped task

Each folder is exactly what `asyncflow prepare TASK --seed 0 --out DIR` writes: a Hugging Face model
folder, the task's train/eval data and the manifest `asyncflow_task.json` (the base model's greedy
eval score, the library versions it was built with and the sha256 of every file), which
tests/test_base_models.py checks. Commit the folders it rewrites.
"""

from __future__ import annotations

import importlib
import json
import sys

from asyncflow.tasks import tiny

SHIPPED = ("arith", "calc")  # the task packs whose seed-0 base model ships in the package
SEED = 0


def main(tasks: list[str]) -> int:
    for name in tasks or SHIPPED:
        module = importlib.import_module(f"asyncflow.tasks.{name}")
        out = tiny.SHIPPED_DIR / module.folder_name(SEED)
        for stale in tiny.SHIPPED_DIR.glob(f"{name}-*"):  # (an older VERSION's folder)
            if stale != out:
                print(f"remove {stale}")
                for f in stale.iterdir():
                    f.unlink()
                stale.rmdir()
        module.prepare(out, seed=SEED, log=print)
        meta = json.loads((out / tiny.MANIFEST).read_text())
        print(f"wrote {out}: {json.dumps({k: v for k, v in meta.items() if k != 'files'})}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
