#!/usr/bin/env bash
# The wheels the lent GPU machine lacks, into the ignored .whl/ that the device run carries (scripts/gpu_check.py).
#
# The machine (Python 3.12, x86-64, no network) has torch, triton, transformers, tokenizers, safetensors, aiohttp,
# uvloop, prometheus-client, numpy, jinja2, tqdm, pyyaml, requests, pytest, pytest-timeout and hypothesis
# (/work/.library/device/KINDS.md), but none of pyproject.toml's msgspec, pyzmq, gguf and llguidance. gguf's own
# needs (numpy, pyyaml, requests, tqdm) are there; the other three need nothing. Versions are the ones this project
# is developed and tested against. Run from anywhere: bash scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(msgspec==0.22.0 pyzmq==27.3.0 gguf==0.19.0 llguidance==1.9.1)
PLATFORMS=(manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

rm -rf .whl
mkdir -p .whl
platform_args=()
for platform in "${PLATFORMS[@]}"; do platform_args+=(--platform "$platform"); done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platform_args[@]}" -d .whl "${WHEELS[@]}"

count=$(ls .whl/*.whl | wc -l)
if [ "$count" -ne "${#WHEELS[@]}" ]; then
    echo "expected ${#WHEELS[@]} wheels in .whl/, found $count" >&2
    exit 1
fi
ls -l .whl
du -sh .whl

# Where a Python 3.12 is at hand, install them as the device run does and import them (gguf's numpy is not asked).
if command -v python3.12 >/dev/null && python3.12 -c "" 2>/dev/null; then
    site=$(mktemp -d)
    python3.12 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    PYTHONPATH="$site" python3.12 -c "import llguidance, msgspec, zmq; print('python3.12 imports msgspec', msgspec.__version__, 'pyzmq', zmq.__version__, 'and llguidance')"
    rm -rf "$site"
fi
