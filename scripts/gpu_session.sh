#!/usr/bin/env bash
# Everything kdax measures on a CUDA GPU, one stage per call of at most 10 minutes (Triton
# compiles take most of it), in order of importance:
#   scripts/gpu_session.sh compare [BxT,...]       kdax bench gpu-compare, FLA in its own process;
#                                                  default 1x8192 (the acceptance shape), then e.g.
#                                                  1x2048,1x32768 and 8x2048,8x8192,8x32768
#   scripts/gpu_session.sh report                  the compile budget (scripts/gpu_compile_report.py
#                                                  --fla-options --check, bf16, then float32): spills
#                                                  and issued warp-instructions beside FLA's; then the
#                                                  Kascade kernels' (--op kascade --check, both dtypes)
#   scripts/gpu_session.sh tests [FILE|TEST ...]   pallas_gpu compiled for real: every shared case,
#                                                  fp32 and bf16, the cases CI leaves to the slow
#                                                  marker included, on 16 pytest workers (67 tests
#                                                  took about 9 minutes on an H100 before 11 slow
#                                                  ones joined: run test_chunk.py, then
#                                                  test_pallas_gpu.py and test_fla_parity.py, or node
#                                                  ids); failures go to $OUT/failures.txt as they happen
#   scripts/gpu_session.sh tune [KERNELS] [BVxBK]  kdax bench gpu-tune: the block sizes (KERNELS
#                                                  none, the default), then one or two kernels'
#                                                  launches per call at the blocks found
#   scripts/gpu_session.sh kascade [T] [CACHE]     the Kascade kernels compiled: their tests, then
#                                                  kdax bench kascade, xla and pallas_gpu against
#                                                  jax.nn.dot_product_attention (B=1 H=32 G=8 D=128
#                                                  bf16 prefill at T, default 32768; decode B=64 over
#                                                  CACHE keys, default 32768)
#   scripts/gpu_session.sh decode                  the decode kernel (fused_recurrent_kda, pallas_gpu) compiled: its
#                                                  tests, its compile report (--op decode --check), then a
#                                                  decode step against the xla scan at B = 1, 8, 64, H = 32,
#                                                  K = V = 128, bf16, the gate, norm and beta in the op
# Expects jax with CUDA, torch and triton; FLA's wheels in .wheels/ (installed to /tmp/site).
# Results and logs go to $OUT (default ./gpu_out) as they are made, so a stage cut short keeps them.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if compgen -G ".wheels/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .wheels/*.whl
fi
export PYTHONPATH="$PWD:/tmp/site:${PYTHONPATH:-}" XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax; assert jax.default_backend() == 'gpu', jax.devices(); print('jax', jax.__version__, jax.devices())" \
  | tee -a "$OUT/gpu.txt"
stage=${1:-compare}
case "$stage" in
  tests)
    shift
    targets=("$@")
    [ ${#targets[@]} -gt 0 ] || targets=(tests/ops/kda/test_chunk.py tests/ops/kda/test_pallas_gpu.py
                                         tests/ops/kda/test_fla_parity.py -k "pallas_gpu or gpu")
    KDAX_FAILURE_LOG="$OUT/failures.txt" python3 -m pytest -v -p no:cacheprovider -p no:benchmark -n 16 \
      -m "" --durations=20 --timeout=480 "${targets[@]}" 2>&1 | tee "$OUT/tests.txt" ;;
  report)
    for dtype in bfloat16 float32; do
      python3 scripts/gpu_compile_report.py --fla-options --check --dtype $dtype 2>&1 | tee "$OUT/report-$dtype.md" || true
    done
    for dtype in bfloat16 float32; do
      python3 scripts/gpu_compile_report.py --op kascade --check --dtype $dtype 2>&1 \
        | tee "$OUT/report-kascade-$dtype.md" || true
    done ;;
  tune)
    name="tune-${2:-none}"
    python3 -m kdax.cli bench gpu-tune --repeats 10 --kernels "${2:-none}" ${3:+--blocks "$3"} \
      > "$OUT/$name.json" 2> >(tee "$OUT/$name.log" >&2)
    cat "$OUT/$name.json" ;;
  compare)
    shapes=${2:-1x8192}
    name="compare-${shapes//,/_}"
    python3 -m kdax.cli bench gpu-compare --repeats 20 --shapes "$shapes" --workdir "$OUT/$name" --json \
      > "$OUT/$name.json" 2> >(tee "$OUT/$name.log" >&2)
    python3 -c "import json,sys; from kdax.bench.fla_compare import format_compare; \
print(format_compare(json.load(open(sys.argv[1]))))" "$OUT/$name.json" | tee "$OUT/$name.md" ;;
  kascade)
    python3 -m pytest -v -p no:cacheprovider -p no:benchmark -n 4 --timeout=300 tests/ops/kascade/test_pallas.py \
      -k pallas_gpu 2>&1 | tee "$OUT/kascade-tests.txt" || true
    name="kascade-${2:-32768}-${3:-32768}"
    python3 -m kdax.cli bench kascade --T "${2:-32768}" --H 32 --kv-heads 8 --head-dim 128 --dtype bfloat16 \
      --cache-len "${3:-32768}" --decode-batch 64 --backends xla,pallas_gpu --repeats 10 --json \
      > "$OUT/$name.json" 2> >(tee "$OUT/$name.log" >&2)
    python3 -c "import json,sys; from kdax.bench.kascade import Row, format_table; \
print(format_table([Row(**{**r, 'iqr_ms': tuple(r['iqr_ms'])}) for r in json.load(open(sys.argv[1]))['kascade']]))" \
      "$OUT/$name.json" | tee "$OUT/$name.md" ;;
  decode)
    python3 -m pytest -v -p no:cacheprovider -p no:benchmark -m "" --timeout=300 tests/ops/kda/test_decode.py \
      -k "pallas_gpu or gpu" 2>&1 | tee "$OUT/decode-tests.txt" || true
    python3 scripts/gpu_compile_report.py --op decode --check 2>&1 | tee "$OUT/report-decode.md" || true
    python3 - <<'PY' 2>&1 | tee "$OUT/decode-timing.md"
import time
import jax, jax.numpy as jnp, kdax
from kdax.bench.measure import jax_batch, time_batches
H, K, V = 32, 128, 128
print("| B | backend | median us (IQR) |\n|---|---|---|")
for B in (1, 8, 64):
    ks = jax.random.split(jax.random.key(B), 6)
    x = lambda i, *s: jax.random.normal(ks[i], (B, 1, *s), jnp.bfloat16)
    args = (x(0, H, K), x(1, H, K), x(2, H, V), x(3, H, K), x(4, H), jax.random.normal(ks[5], (B, H, K, V)))
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                A_log=jnp.zeros((H,)), dt_bias=jnp.zeros((H * K,)), output_final_state=True)
    for backend in ("xla", "pallas_gpu"):
        f = jax.jit(lambda q, k, v, g, b, h0, backend=backend: kdax.fused_recurrent_kda(
            q, k, v, g, b, initial_state=h0, backend=backend, **opts))
        t = time_batches(jax_batch(f, args), 20)
        print(f"| {B} | {backend} | {1e3 * t.median:.1f} ({1e3 * t.q25:.1f}-{1e3 * t.q75:.1f}) |")
    # a decode step on a donated pool of 4B slots: the kernel in place against xla's gather and scatter
    opts.pop("output_final_state")
    idx = 4 * jnp.arange(B, dtype=jnp.int32)
    for backend in ("xla", "pallas_gpu"):
        f = jax.jit(lambda pool, q, k, v, g, b, backend=backend: kdax.fused_recurrent_kda(
            q, k, v, g, b, initial_state=pool, ssm_state_indices=idx, backend=backend, **opts), donate_argnums=0)
        box = [jax.random.normal(ks[5], (4 * B, H, K, V))]
        def batch(n):
            t0 = time.perf_counter()
            for _ in range(n):
                o, box[0] = f(box[0], *args[:5])
            jax.block_until_ready(box[0])
            return 1e3 * (time.perf_counter() - t0) / n
        t = time_batches(batch, 20)
        print(f"| {B} | {backend}, slots | {1e3 * t.median:.1f} ({1e3 * t.q25:.1f}-{1e3 * t.q75:.1f}) |")
PY
    ;;
  *) echo "unknown stage $stage (compare, report, tests, tune, kascade, decode)" >&2; exit 2 ;;
esac
