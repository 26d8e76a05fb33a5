#!/usr/bin/env bash
# Run where pip reaches PyPI, before carrying the checkout to the GPU machine: downloads the wheels
# of scripts/gpu_check_wheels.txt (what the device image lacks) for its Python into DEST (default
# .whl/, ignored by git); scripts/gpu_check.sh installs them there with no network.
#   bash scripts/gpu_check_prepare.sh                       # Python 3.12, into .whl/
#   bash scripts/gpu_check_prepare.sh --python-version 3.11 --dest DIR
# Python: $PYTHON, else .venv/bin/python when present, else python3 (only its pip is used).
set -euo pipefail
cd "$(dirname "$0")/.."
pyver=3.12
dest=.whl
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) pyver=$2; shift 2 ;;
    --dest) dest=$2; shift 2 ;;
    *) echo "unknown argument: $1 (allowed: --python-version X.Y, --dest DIR)" >&2; exit 2 ;;
  esac
done
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
mapfile -t reqs < <(grep -v '^\s*#' scripts/gpu_check_wheels.txt | grep -v '^\s*$')
mkdir -p "$dest"
rm -f "$dest"/*.whl   # NOTE: one version of each: two of a package stop the whole install
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 \
         manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  "${platforms[@]}" -d "$dest" "${reqs[@]}"
n=$(ls "$dest"/*.whl | wc -l)
if [ "$n" -ne "${#reqs[@]}" ]; then
  echo "expected ${#reqs[@]} wheels in $dest, found $n" >&2; exit 1
fi
echo "$n wheels for Python $pyver in $dest ($(du -sh "$dest" | cut -f1))"
