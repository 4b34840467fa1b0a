#!/usr/bin/env bash
# The GPU check of issue 34 as one command, from the repository root of a CUDA machine:
#   bash benchmarks/gpu/run.sh            (or: make bench-gpu)
# 1. installs the wheels in .whl/ (made beforehand by `make gpu-wheels` on a machine with PyPI:
#    the packages a bare GPU image lacks: dp-accounting, dm-tree, opacus, kymatio), if any;
# 2. runs the tests that need CUDA (the certification trajectory on the device, one
#    synchronisation per private step under torch.cuda.set_sync_debug_mode, the
#    simulated-device tests, the step's structure);
# 3. runs benchmarks/gpu_speed.py within 300 s.
# Logs and gpu_speed.json go to $OUT (the device tool's folder) or benchmarks/out.
set -uo pipefail
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -c "import torch, clipless; print('torch', torch.__version__, torch.cuda.get_device_name())"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_certification_trajectory.py \
    tests/test_step_structure.py tests/test_devices.py tests/test_carried_on_device.py \
    tests/test_sealed_step.py 2>&1 \
    | tee "$OUT/cuda_tests.log"
timeout 300 python3 benchmarks/gpu_speed.py --out "$OUT" 2>&1 | tee "$OUT/gpu_speed.log"
