#!/usr/bin/env bash
# A new user's first hour, checked (issue 27): build the wheel, install it into a clean
# venv outside the checkout, then run `kvstate demo` from a folder outside any checkout,
# `kvstate demo` again from inside the checkout (its processes must import the installed
# kvstate, not the checkout's), and the README's first snippet (numpy installed for it).
# Prints the venv's size and fails past WHEEL_VENV_LIMIT_MB (50). `.ci/run` runs it.
#
#   bash tools/wheel-check.sh            # PYTHON=python3.11 to choose the interpreter
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
LIMIT_MB="${WHEEL_VENV_LIMIT_MB:-50}"
WORK="$(mktemp -d /tmp/kvstate-wheel-check.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
say() { echo "wheel-check: $*"; }

# The wheel is built from the files git would commit (tracked and new, not ignored), so a
# stale build/ or an in-place extension of this checkout cannot slip into it.
mkdir "$WORK/src"
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard) \
    | (cd "$ROOT" && xargs -0 tar -cf - --no-recursion) | tar -xf - -C "$WORK/src"
"$PYTHON" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip wheel -q --no-deps -w "$WORK/dist" "$WORK/src"
WHEEL="$(ls "$WORK"/dist/kvstate-*.whl)"
say "built $(basename "$WHEEL") ($(du -k "$WHEEL" | cut -f1) KiB)"

"$VPY" -m pip install -q "$WHEEL"
SIZE_MB="$(du -sm "$WORK/venv" | cut -f1)"
say "venv with the wheel and its dependencies: ${SIZE_MB} MB (limit ${LIMIT_MB} MB):" \
    "$("$VPY" -m pip list --format=freeze | tr '\n' ' ')"

mkdir "$WORK/elsewhere"
say "kvstate demo, from a folder outside any checkout"
(cd "$WORK/elsewhere" && "$WORK/venv/bin/kvstate" demo)
say "kvstate demo --tp 2, from inside the checkout"
(cd "$ROOT" && "$WORK/venv/bin/kvstate" demo --tp 2 --json > "$WORK/inside.json") \
    || { cat "$WORK/inside.json"; exit 1; }
"$VPY" -c 'import json, sys; r = json.load(open(sys.argv[1])); sys.exit(0 if r["ok"] else "not ok: " + r["outcome"])' \
    "$WORK/inside.json"

say "the README's first snippet, from a folder outside any checkout (numpy installed for it)"
"$VPY" -m pip install -q numpy
(cd "$WORK/elsewhere" && "$VPY" - "$ROOT/README.md" <<'EOF'
import re, sys
code = re.search(r"```python\n(.*?)```", open(sys.argv[1], encoding="utf-8").read(), re.S).group(1)
exec(compile(code, "README.md (first python snippet)", "exec"), {"__name__": "__main__"})
import kvstate
assert "/venv/" in kvstate.__file__, kvstate.__file__
print("README snippet: ran, every assert held, kvstate from", kvstate.__file__)
EOF
)

if [ "$SIZE_MB" -gt "$LIMIT_MB" ]; then
    say "FAILED: the venv is ${SIZE_MB} MB, over ${LIMIT_MB} MB"
    exit 1
fi
say "passed: venv ${SIZE_MB} MB"
