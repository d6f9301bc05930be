#!/usr/bin/env bash
# Run the test suite as CI does: prepare the machine (scripts/setup.sh), then pytest.
# Extra arguments go to pytest:  bash scripts/test.sh -k sandbox -x
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/setup.sh
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
# Bytecode: with PYTHONDONTWRITEBYTECODE set (this machine's environment sets it), every
# `python -m provision` the tests start (a few thousand) compiles provision's modules again:
# 0.28 s of CPU a call measured (0.9 s -> 0.6 s). It is written to a cache outside the
# clone instead, which stays as clean as before.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-${XDG_CACHE_HOME:-$HOME/.cache}/provision/pycache}"
# --timeout: a hung SSH call or host must fail its test, not eat CI's 90 minutes; a first
# run builds the host image and the TensorFlow layer inside a test, hence 15 minutes.
# pytest's own exit code is kept: 5 (no tests collected) fails the run like any error.
# Lint and types first (seconds): ruff for style and bugs, mypy strict on every module but
# the few pyproject.toml's overrides name.
"${PYTHON:-python3}" -m ruff check src tests bench
"${PYTHON:-python3}" -m ruff format --check src tests bench
"${PYTHON:-python3}" -m mypy
# -n 2 --dist loadgroup: the tests that start hosts in one worker, in order (tests/conftest.py
# groups them), the rest in the other beside them: ~4 of the suite's ~32 minutes were those.
exec "${PYTHON:-python3}" -m pytest -ra --durations=20 --timeout=900 -n 2 --dist loadgroup "$@"
