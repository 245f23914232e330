#!/usr/bin/env bash
# Everything kdax measures on a CUDA GPU, one stage per call (each fits in 10 minutes):
#   scripts/gpu_session.sh tests     pallas_gpu compiled for real: every shared case, fp32 and bf16
#   scripts/gpu_session.sh tune      the launch table (kdax bench --gpu-tune)
#   scripts/gpu_session.sh compare   kdax bench --gpu-compare-fla (FLA in its own process)
# Expects jax with CUDA, torch and triton installed; FLA's wheels in .wheels/ (installed to
# /tmp/site). Results go to $OUT (default ./gpu_out).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
if compgen -G ".wheels/*.whl" > /dev/null; then
  pip install -q --no-deps --target /tmp/site .wheels/*.whl
fi
export PYTHONPATH="$PWD:/tmp/site:${PYTHONPATH:-}" XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
case "${1:-tests}" in
  tests) python -m pytest -q -p no:cacheprovider tests/ops/kda/test_chunk.py tests/ops/kda/test_pallas_gpu.py \
           tests/ops/kda/test_fla_parity.py \
           -k "pallas_gpu or gpu" 2>&1 | tee "$OUT/tests.txt" | tail -30 ;;
  tune) python -m kdax.bench.cli bench --gpu-tune --repeats 10 | tee "$OUT/tune.json" ;;
  compare) python -m kdax.bench.cli bench --gpu-compare-fla --repeats 20 --json > "$OUT/compare.json"
           python -c "import json,sys; from kdax.bench.fla_compare import format_compare; \
print(format_compare(json.load(open(sys.argv[1]))))" "$OUT/compare.json" | tee "$OUT/compare.md" ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
