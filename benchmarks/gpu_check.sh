#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py) as one command on an offline GPU machine:
# PYTHONPATH=src, and crc32c (the store's checksum; not on such a machine) installed from the
# carried wheel when `import crc32c` fails. Its options are gpu_check.py's, e.g.
#
#   STMOE_COMMIT=<sha> benchmarks/gpu_check.sh --out "$OUT/gpu_check.json"
#
# It carries two ignored paths: .whl (wheels the GPU machine lacks: crc32c, the store's
# checksum; pytest and its dependencies, for the cuda-marked tests' stage) and
# out/gpu_check (the recorded routing the decode table replays: `benchmarks/gpu_check.py
# --prepare` writes it here, from ../shared/traces, which the GPU machine has not). The
# wheels are not committed (.gitignore: /.whl/); fetch them where pip reaches PyPI, for the
# GPU machine's python (3.12, x86-64):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl crc32c==2.9.post0
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl \
#       pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pygments==2.21.0
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
site=${TMPDIR:-/tmp}/stmoe-gpu-check-site
for module in crc32c pytest pluggy iniconfig packaging pygments; do
    if "$PY" -c "import $module" 2>/dev/null; then
        continue
    fi
    wheel=$(ls .whl/"$module"-*.whl 2>/dev/null | head -n 1)
    if [ -z "$wheel" ]; then
        if [ "$module" = crc32c ]; then  # the store cannot be checked without it
            echo "gpu_check.sh: crc32c is missing and no .whl/crc32c-*.whl was carried (see" \
                 "this script's header for the download command)" >&2
            exit 1
        fi
        echo "gpu_check.sh: $module is missing and not carried: the cuda-marked tests" \
             "will not run (see this script's header)" >&2
        continue
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$wheel" || exit 1
done
export PYTHONPATH="$PYTHONPATH:$site"
exec "$PY" benchmarks/gpu_check.py "$@"
