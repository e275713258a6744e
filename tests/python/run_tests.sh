#!/usr/bin/env bash
# The Python package's tests (CTest's python_ops): pytest on tests/python with the package as the build
# laid it out (BUILD/python/carry), in a python3 that imports the torch carry was built against (TORCH_DIR)
# and pytest: CARRY_PYTHON, then .venv's (launcher/python_env readies it), then python3. Without one the
# test is skipped (exit 77) and says why. CARRY_BINARY: the carry program, for the `carry mixer` check.
# usage: tests/python/run_tests.sh REPO_ROOT BUILD TORCH_DIR CARRY_BINARY [pytest args]
set -euo pipefail
root=$1 build=$2 torch_dir=$3 carry=$4
shift 4
py=""
for cand in "${CARRY_PYTHON:-}" "$root/.venv/bin/python3" python3; do
  [ -n "$cand" ] && command -v "$cand" >/dev/null || continue
  if "$cand" - "$torch_dir" >/dev/null 2>&1 <<'PY'
import os, sys
import pytest, torch
sys.exit(os.path.realpath(os.path.dirname(torch.__file__)) != os.path.realpath(sys.argv[1]))
PY
  then py=$cand; break; fi
done
if [ -z "$py" ]; then
  echo "python_ops: skipped: no python3 here imports pytest and the torch carry was built against ($torch_dir);" \
       "launcher/setup installs them into .venv (launcher/python_env)"
  exit 77
fi
cd "$root/tests/python"
PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m pytest -q -p no:cacheprovider \
  --carry-binary "$carry" "$@" .
