#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py) as one command on an offline GPU machine:
# PYTHONPATH=src, and crc32c (the store's checksum; not on such a machine) installed from the
# carried wheel when `import crc32c` fails. Its options are gpu_check.py's, e.g.
#
#   STMOE_COMMIT=<sha> benchmarks/gpu_check.sh --out "$OUT/gpu_check.json"
#
# It carries two ignored paths: .whl (the crc32c wheel) and out/gpu_check (the recorded
# routing the decode table replays: `benchmarks/gpu_check.py --prepare` writes it here, from
# ../shared/traces, which the GPU machine has not). The wheel is not committed (.gitignore:
# /.whl/); fetch it where pip reaches PyPI, for the GPU machine's python (3.12, x86-64):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl crc32c==2.9.post0
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! "$PY" -c "import crc32c" 2>/dev/null; then
    wheel=$(ls .whl/crc32c-*.whl 2>/dev/null | head -n 1)
    if [ -z "$wheel" ]; then
        echo "gpu_check.sh: crc32c is missing and no .whl/crc32c-*.whl was carried (see this" \
             "script's header for the download command)" >&2
        exit 1
    fi
    site=${TMPDIR:-/tmp}/stmoe-gpu-check-site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$wheel" || exit 1
    export PYTHONPATH="$PYTHONPATH:$site"
fi
exec "$PY" benchmarks/gpu_check.py "$@"
