#!/usr/bin/env bash
# Builds the wheelhouse .gpu_wheels/ that tools/gpu_check.sh installs offline on a GPU machine
# (Python 3.12, x86_64, no network): cp312 manylinux wheels of tools/gpu_requirements.txt and of
# their dependencies, less what the GPU image already has through torch and transformers.
#
#     bash tools/gpu_wheels.sh            # build (skipped when built from the same list)
#     bash tools/gpu_wheels.sh --force    # build again
#     bash tools/gpu_wheels.sh --verify   # also install it into a fresh Python 3.12 venv in /tmp
#                                         # and import each package there
#
# Runs where PyPI is reachable. PYTHON picks the pip that downloads (default: python);
# PYTHON312 the interpreter of --verify (default: the first python3.12 found).
set -euo pipefail
cd "$(dirname "$0")/.."

REQ=tools/gpu_requirements.txt
DEST=.gpu_wheels
STAMP=$DEST/.built_from
PY=${PYTHON:-python}
FORCE=0 VERIFY=0
for arg in "$@"; do
  case $arg in
    --force) FORCE=1 ;;
    --verify) VERIFY=1 ;;
    *) echo "usage: bash tools/gpu_wheels.sh [--force] [--verify]" >&2; exit 2 ;;
  esac
done

# The GPU image's own packages (torch's and transformers' dependencies included): never in the
# wheelhouse, even when a listed package depends on them (matplotlib on numpy, latex2sympy2 on sympy).
IMAGE_HAS='torch|triton|nvidia[-_].*|transformers|tokenizers|safetensors|huggingface[-_]hub|hf[-_]xet|numpy|sympy|mpmath|networkx|jinja2|markupsafe|filelock|fsspec|setuptools'
PLATFORM=(--only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --implementation cp --abi cp312)

requirements() {  # the list's requirement lines, comments stripped; $1: "deps" or "no-deps" lines
  if [ "$1" = no-deps ]; then grep -E '^[^#].*#\s*no-deps' "$REQ" | sed 's/#.*//; s/\s*$//'
  else grep -vE '^\s*(#|$)' "$REQ" | grep -vE '#\s*no-deps' | sed 's/#.*//; s/\s*$//'; fi
}

mapfile -t DEPS < <(requirements deps)
mapfile -t NODEPS < <(requirements no-deps)

summary() {
  echo "wheelhouse $DEST/:"
  local w n=0
  for w in "$DEST"/*.whl; do printf '  %8s  %s\n' "$(du -k "$w" | cut -f1)K" "${w#"$DEST"/}"; n=$((n + 1)); done
  echo "total: $n wheels, $(du -ch "$DEST"/*.whl | tail -1 | cut -f1) ($(du -cb "$DEST"/*.whl | tail -1 | cut -f1) bytes)"
}

key=$(cat "$REQ" tools/gpu_wheels.sh | sha256sum | cut -d' ' -f1)
if [ "$FORCE" = 0 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$key" ]; then
  echo "$DEST/ is already built from this $REQ (--force builds it again)"
else
  tmp=$DEST.tmp
  rm -rf "$tmp" && mkdir -p "$tmp"
  # antlr4-python3-runtime 4.9.3 (hydra's and omegaconf's pin) is published as an sdist only: build
  # its wheel first, so that the download below finds it through --find-links.
  antlr=$(printf '%s\n' "${DEPS[@]}" | grep -i '^antlr4-python3-runtime' || true)
  if [ -n "$antlr" ]; then
    "$PY" -m pip wheel --no-deps "$antlr" -w "$tmp"
  fi
  # The dependencies at the versions installed here where this environment has them (the versions
  # the CPU test suite runs with), the newest otherwise; the listed pins win over this environment.
  constraints=$(mktemp)
  listed=$(printf '%s\n' "${DEPS[@]}" "${NODEPS[@]}")
  listed_names=$(echo "$listed" | sed -E 's/[<>=!~; \[].*//' | tr 'A-Z_.' 'a-z--' | paste -sd'|')
  "$PY" -m pip list --format=freeze --exclude-editable 2>/dev/null \
    | grep -vE '^\s*(-e|#)' | grep '==' \
    | awk -F'==' -v skip="^($listed_names|$IMAGE_HAS)\$" '{n=tolower($1); gsub(/[_.]/, "-", n); if (n !~ skip) print}' \
    > "$constraints" || true
  if ! "$PY" -m pip download "${PLATFORM[@]}" -d "$tmp" --find-links "$tmp" -c "$constraints" \
       "${DEPS[@]}"; then
    echo "download with this environment's versions as constraints failed: again without them" >&2
    "$PY" -m pip download "${PLATFORM[@]}" -d "$tmp" --find-links "$tmp" "${DEPS[@]}"
  fi
  rm -f "$constraints"
  if [ ${#NODEPS[@]} -gt 0 ]; then
    "$PY" -m pip download "${PLATFORM[@]}" --no-deps -d "$tmp" "${NODEPS[@]}"
  fi
  echo "left out (the GPU image has them):"
  for w in "$tmp"/*.whl; do
    name=$(basename "$w" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')
    if [[ $name =~ ^($IMAGE_HAS)$ ]] && ! echo "$listed" | tr 'A-Z_.' 'a-z--' | grep -q "^$name\b"; then
      echo "  $(basename "$w")"
      rm -f "$w"
    fi
  done
  rm -rf "$DEST" && mv "$tmp" "$DEST"
  echo "$key" > "$STAMP"
fi
summary

if [ "$VERIFY" = 1 ]; then
  py312=${PYTHON312:-}
  if [ -z "$py312" ]; then
    for c in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
      if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then py312=$c; break; fi
    done
  fi
  [ -n "$py312" ] || { echo "--verify: no python3.12 found (set PYTHON312)" >&2; exit 1; }
  venv=$(mktemp -d /tmp/gpu_wheels_verify.XXXXXX)
  echo "--verify: fresh venv $venv ($("$py312" --version))"
  "$py312" -m venv "$venv"
  vpy=$venv/bin/python
  # What the GPU image brings and the wheelhouse leaves out, from the index: a stand-in for the image.
  "$vpy" -m pip install -q numpy sympy
  # Then the wheelhouse alone, as on the GPU machine: no index, no pip configuration of this machine.
  offline=(env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null "$vpy" -m pip install --no-index --find-links "$DEST")
  "${offline[@]}" "${DEPS[@]}"
  # megatron-core needs torch, which this venv does not have: its wheel alone.
  [ ${#NODEPS[@]} -eq 0 ] || "${offline[@]}" --no-deps "${NODEPS[@]}"
  "$vpy" - <<'EOF'
import importlib
import sys
failed = []
for name in ["hydra", "omegaconf", "antlr4", "zmq", "msgspec", "fastapi", "starlette", "uvicorn", "aiohttp", "rich",
             "lark", "pebble", "math_verify", "latex2sympy2_extended", "prometheus_client", "matplotlib.pyplot",
             "pytest", "pytest_timeout", "hypothesis"]:
    try:
        module = importlib.import_module(name)
        print(f"  import {name}: ok {getattr(module, '__version__', '')}")
    except Exception as e:  # noqa: BLE001 - report every failure, then fail
        failed.append(name)
        print(f"  import {name}: FAILED {type(e).__name__}: {e}")
from math_verify import parse, verify
assert verify(parse("$\\frac{1}{2}$"), parse("0.5")), "math_verify does not verify 1/2 = 0.5"
print("  math_verify: 1/2 = 0.5 verified")
sys.exit(1 if failed else 0)
EOF
  "$vpy" -c 'import importlib.metadata as m; print(f"  megatron-core {m.version("megatron-core")}: installed (importing it needs torch)")'
  rm -rf "$venv"
  echo "--verify: ok"
fi
