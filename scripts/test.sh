#!/usr/bin/env bash
# The test command (README, .ci/run): installs what the tests need, then lint, type check, tests.
# torch 2.13.0 (CPU) is installed first and explicitly: any other torch requirement would make pip
# fetch a multi-GB CUDA build on these machines.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check "torch==2.13.0"
python -m pip install -q --disable-pip-version-check -e ".[test]"
echo "== ruff"; python -m ruff check asyncflow tests
echo "== mypy"; python -m mypy
echo "== pytest"; python -m pytest -q "$@"
