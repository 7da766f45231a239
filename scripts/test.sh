#!/usr/bin/env bash
# The test command (README, .ci/run): installs what the tests need, then lint, type check, tests.
# Extra arguments go to pytest (e.g. -m "not slow and not ray and not soak" for the fast subset).
# torch: a torch that is already installed is kept (a GPU build, or PyTorch's CPU wheel); else
# torch 2.13.0, the version CI tests, is installed first and explicitly, as the README says.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi
python -m pip install -q --disable-pip-version-check -e ".[test]"
echo "== ruff"; python -m ruff check asyncflow tests scripts
echo "== mypy"; python -m mypy
echo "== pytest"; python -m pytest -q "$@"
