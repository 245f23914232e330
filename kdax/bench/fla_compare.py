"""``kdax bench gpu-compare``: kdax (pallas_gpu, xla) against FLA's Triton ``chunk_kda``.

The two run in separate processes (``python -m kdax.bench.fla_compare worker ...``) on
the same inputs: each draws them from the same seeded NumPy generator and rounds to
bfloat16 the same way. Both use the in-op options of a Kimi Linear layer (q/k L2 norm,
the gate ``-exp(A_log) softplus(g + dt_bias)``, beta = sigmoid) and the loss
0.5 sum(o^2) for the backward. Both time batches of back-to-back calls (about
:data:`kdax.bench.measure.BATCH_MS` each, at most 10 calls) so that launch overhead is amortised the same
way: FLA with CUDA events around the batch, JAX with a host clock around it and one
``block_until_ready`` at its end (:func:`kdax.bench.measure.time_batches`); the median and
quartiles over ``repeats`` batches, after warm-up.
Each worker rewrites its results after every shape, so a run cut short keeps what it timed.
kdax compiles each pass ahead of time and reports the seconds it took.
For the first shape each worker also traces :data:`PROFILE_CALLS` calls of each pass and
reports the device time per kernel (kdax pallas_gpu with ``jax.profiler``, right after its
timings and before the xla backend's, FLA with ``torch.profiler``): where the time goes
when the ratio is missed.

TFLOP/s and GB/s use the algorithmic counts of :func:`flops` and :func:`min_bytes`
(the same for every implementation), against a bf16 matmul peak and a device-to-device
copy bandwidth measured in the FLA process.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from kdax.bench import flags
from kdax.bench.measure import jax_batch, rel_rms, time_batches
from kdax.ops.kda.shapes import BENCHMARK, FLA_SWEEP

SHAPES = [(s.B, s.T) for s in FLA_SWEEP]  # (B, T)
H, K, V, CHUNK = BENCHMARK.H, BENCHMARK.K, BENCHMARK.V, BENCHMARK.chunk_size
SMALL = (1, 512, 4)  # (B, T, H) of the error check
PROFILE_CALLS = 5  # calls traced per pass for the per-kernel profile of the first shape


def kernel_profile(events, calls: int) -> list[dict]:
    """Device time per kernel of ``calls`` traced calls: events [(name, µs)] -> rows
    {"kernel", "us" per call, "launches" per call}, longest first."""
    total, count = {}, {}
    for name, us in events:
        total[name] = total.get(name, 0.0) + us
        count[name] = count.get(name, 0) + 1
    rows = [{"kernel": n, "us": total[n] / calls, "launches": count[n] / calls} for n in total]
    return sorted(rows, key=lambda r: -r["us"])


def gpu_stream_events(data) -> list[tuple[str, float]]:
    """[(name, µs)] of every event on the stream lines of a ``jax.profiler.ProfileData``'s GPU
    planes: kernels, copies and memsets (not the CUPTI overhead line)."""
    lines = [ln for p in data.planes if p.name.startswith("/device:GPU") for ln in p.lines]
    streams = [ln for ln in lines if ln.name.startswith("Stream #")]
    if not streams:
        names = [p.name for p in data.planes], [ln.name for ln in lines]
        raise ValueError(f"no GPU stream lines in the trace (planes {names[0]}, GPU lines {names[1]})")
    return [(e.name, e.duration_ns / 1e3) for ln in streams for e in ln.events]


def jax_kernel_profile(f, args, calls: int = PROFILE_CALLS) -> list[dict]:
    """:func:`kernel_profile` of ``calls`` calls of a compiled ``f(*args)`` on a GPU, traced by jax.profiler."""
    import jax

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                out = f(*args)
            jax.block_until_ready(out)
        (path,) = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        return kernel_profile(gpu_stream_events(jax.profiler.ProfileData.from_file(path)), calls)


def _profiled(B, T, passes: dict) -> dict:
    """The profile entry of a worker's result: per pass, :func:`kernel_profile` rows, from
    ``passes`` {pass: a function returning them}; an error is reported in place of the rows."""
    out = {"B": B, "T": T, "calls": PROFILE_CALLS}
    for mode, rows in passes.items():
        try:
            out[mode] = rows()
        except Exception as e:  # noqa: BLE001 (a profiler that fails must not cost the timings)
            out[mode] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def _save(result: dict, out: str) -> None:
    with open(out + ".json", "w") as f:
        json.dump(result, f)


def flops(B, T, H, K, V, C=CHUNK, backward=False):
    """Algorithmic FLOPs of chunked KDA: per chunk and head, Aqk and Akk (2 x 2 C^2 K),
    w and u (2 C^2 (K + V)), the state pass and output (3 x 2 C K V, 2 C^2 V); the
    backward counted as twice the forward."""
    per_chunk = 4 * C * C * K + 2 * C * C * (K + V) + 6 * C * K * V + 2 * C * C * V
    fwd = B * H * -(-T // C) * per_chunk
    return 3 * fwd if backward else fwd


def min_bytes(B, T, H, K, V, elem=2, backward=False):
    """Fewest bytes through HBM: read q, k, v, g, beta, write o; the backward also reads
    them and do, and writes dq, dk, dv, dg, dbeta."""
    fwd = B * T * H * elem * (3 * K + 2 * V + 1)
    return fwd + B * T * H * elem * ((3 * K + 2 * V + 1) + (3 * K + V + 1)) if backward else fwd


def inputs(B, T, H, K, V, seed=0):
    """float32 NumPy arrays (rounded to bf16 by each side): q, k, v, g (raw), beta (raw), A_log, dt_bias."""
    rng = np.random.default_rng(seed)
    n = lambda *s: rng.standard_normal(s, dtype=np.float32)
    A_log = np.log(rng.uniform(1, 16, H)).astype(np.float32)
    return n(B, T, H, K), n(B, T, H, K), n(B, T, H, V), n(B, T, H, K), n(B, T, H), A_log, 0.1 * n(H * K)


# ----------------------------------------------------------------------------- workers


def _fla_worker(shapes, repeats, out):
    import torch
    from fla.ops.kda import chunk_kda

    dev = "cuda"

    def event_ms(fn, repeats=repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def batch(n):
            s.record()
            for _ in range(n):
                fn()
            e.record()
            torch.cuda.synchronize()
            return s.elapsed_time(e) / n

        return time_batches(batch, repeats)

    def peaks():  # bf16 matmul TFLOP/s on random data, device-to-device copy GB/s (read + write)
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        x = torch.randint(0, 255, (2**30,), device=dev, dtype=torch.uint8)
        y = torch.empty_like(x)
        mm, copy = event_ms(lambda: a @ a).median, event_ms(lambda: y.copy_(x)).median
        return 2 * 8192**3 / mm / 1e9, 2 * x.numel() / copy / 1e6

    def profile(fn):
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as trace

        with trace(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILE_CALLS):
                fn()
            torch.cuda.synchronize()
        cuda = torch.autograd.DeviceType.CUDA
        events = [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == cuda]
        return kernel_profile(events, PROFILE_CALLS)

    peak_tflops, copy_gbs = peaks()

    def make(B, T, Hh):
        q, k, v, g, beta, A_log, dt_bias = inputs(B, T, Hh, K, V)
        t = [torch.tensor(z, device=dev).to(torch.bfloat16).requires_grad_() for z in (q, k, v, g, beta)]
        return t, torch.tensor(A_log, device=dev), torch.tensor(dt_bias, device=dev)

    def run(t, A_log, dt_bias):
        o, _ = chunk_kda(
            *t,
            A_log=A_log,
            dt_bias=dt_bias,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
        )
        return o

    def fwd_bwd(t, A_log, dt_bias):  # fresh gradients, as JAX returns (no accumulation into .grad)
        o = run(t, A_log, dt_bias)
        return o, torch.autograd.grad(0.5 * o.float().square().sum(), t)

    result = {"rows": [], "peak_tflops": peak_tflops, "copy_gbs": copy_gbs, "device": torch.cuda.get_device_name()}
    rows = result["rows"]

    def passes(t, A_log, dt_bias):  # the timed calls on one shape's inputs
        def fwd():
            with torch.no_grad():
                return run(t, A_log, dt_bias)

        return {"fwd": fwd, "fwd+bwd": lambda: fwd_bwd(t, A_log, dt_bias)}

    for B, T in shapes:
        fs = passes(*make(B, T, H))
        for mode, fn in fs.items():
            ms, q25, q75 = event_ms(fn)
            rows.append({"B": B, "T": T, "impl": "fla", "mode": mode, "ms": ms, "q25": q25, "q75": q75})
        print(f"fla B={B} T={T}: {rows[-2]['ms']:.3f} / {rows[-1]['ms']:.3f} ms", file=sys.stderr, flush=True)
        _save(result, out)
        if (B, T) == shapes[0]:
            result["profile"] = _profiled(B, T, {mode: functools.partial(profile, fn) for mode, fn in fs.items()})
            _save(result, out)
        del fs
        torch.cuda.empty_cache()
    t, A_log, dt_bias = make(*SMALL)
    o, grads = fwd_bwd(t, A_log, dt_bias)
    np.savez(out + ".npz", **{f"fla_{i}": x.detach().float().cpu().numpy() for i, x in enumerate([o, *grads])})
    return result


def _kdax_worker(shapes, repeats, out, backends=("pallas_gpu", "xla")):
    import jax
    import jax.numpy as jnp

    import kdax

    bf16, f32 = jnp.bfloat16, jnp.float32

    def make(B, T, Hh):
        q, k, v, g, beta, A_log, dt_bias = inputs(B, T, Hh, K, V)
        return [jnp.asarray(z, bf16) for z in (q, k, v, g, beta)] + [jnp.asarray(A_log), jnp.asarray(dt_bias)]

    def fns(backend):
        def op(q, k, v, g, beta, A_log, dt_bias):
            o, _ = kdax.chunk_kda(
                q,
                k,
                v,
                g,
                beta,
                A_log=A_log,
                dt_bias=dt_bias,
                use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True,
                backend=backend,
            )
            return o

        loss = lambda *a: 0.5 * jnp.sum(jnp.square(op(*a).astype(f32)))
        return {"fwd": jax.jit(op), "fwd+bwd": jax.jit(jax.value_and_grad(loss, argnums=tuple(range(5))))}

    result = {"rows": [], "device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
    log = functools.partial(print, file=sys.stderr, flush=True)
    for B, T in shapes:
        args = make(B, T, H)
        for backend in backends:
            profiled = {}  # pass -> compiled for it
            for mode, f in fns(backend).items():
                ms = q25 = q75 = compile_s = None
                log(f"kdax {backend} B={B} T={T} {mode}: compiling")
                try:
                    t0 = time.perf_counter()
                    f = f.lower(*args).compile()
                    compile_s, err = time.perf_counter() - t0, None
                    ms, q25, q75 = time_batches(jax_batch(f, args), repeats)
                    profiled[mode] = f
                except jax.errors.JaxRuntimeError as e:  # e.g. out of memory: reported, not hidden
                    err = f"{type(e).__name__}: {str(e)[:200]}"
                result["rows"].append(
                    {
                        "B": B,
                        "T": T,
                        "impl": f"kdax {backend}",
                        "mode": mode,
                        "ms": ms,
                        "q25": q25,
                        "q75": q75,
                        "error": err,
                        "compile_s": compile_s,
                    }
                )
                log(f"kdax {backend} B={B} T={T} {mode}: {ms if err is None else err} ms, compiled in {compile_s} s")
                _save(result, out)
            if backend == "pallas_gpu" and (B, T) == shapes[0]:  # before the next backend's compiles
                passes = {mode: functools.partial(jax_kernel_profile, f, args) for mode, f in profiled.items()}
                result["profile"] = _profiled(B, T, passes)
                _save(result, out)
        del args
    args = make(*SMALL)
    small = {}
    for backend in backends:
        fwd, bwd = fns(backend).values()
        small[backend] = [np.asarray(x, f32) for x in (fwd(*args), *bwd(*args)[1])]
    with jax.enable_x64(True):
        a64 = [jnp.asarray(np.asarray(x, np.float32), jnp.float64) for x in args]
        fwd64, bwd64 = fns("naive").values()
        small["fp64"] = [np.asarray(fwd64(*a64))] + [np.asarray(x) for x in bwd64(*a64)[1]]
    np.savez(out + ".npz", **{f"{b}_{i}": x for b, xs in small.items() for i, x in enumerate(xs)})
    return result


# ----------------------------------------------------------------------------- orchestration


def _worker(impl, shapes, repeats, out, python):  # its progress and errors go to our stderr
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    cmd = [python, "-m", "kdax.bench.fla_compare", "worker", impl, out, str(repeats), json.dumps(shapes)]
    if subprocess.run(cmd, check=False, env=env).returncode:
        raise RuntimeError(f"the {impl} worker failed ({' '.join(cmd[:5])}); its error is above")
    with open(out + ".json") as f:
        return json.load(f)


def compare(shapes=SHAPES, repeats=20, python=sys.executable, workdir=None) -> dict:
    """Run both workers; return rows with TFLOP/s, GB/s and the ratio to FLA, and the errors.
    ``workdir``: where the workers write (kept), else a temporary folder."""
    if workdir:
        os.makedirs(workdir, exist_ok=True)
    with contextlib.nullcontext(workdir) if workdir else tempfile.TemporaryDirectory() as d:
        fla = _worker("fla", shapes, repeats, os.path.join(d, "fla"), python)
        kd = _worker("kdax", shapes, repeats, os.path.join(d, "kdax"), python)
        f_small, k_small = np.load(os.path.join(d, "fla.npz")), np.load(os.path.join(d, "kdax.npz"))
        names = ("o", "dq", "dk", "dv", "dg", "dbeta")
        fla_small = [f_small[f"fla_{i}"] for i in range(6)]
        errors = {}
        for backend in ("pallas_gpu", "xla"):
            mine = [k_small[f"{backend}_{i}"] for i in range(6)]
            errors[backend] = {
                "vs_fla": max(rel_rms(a, b) for a, b in zip(mine, fla_small)),
                "vs_fp64": max(rel_rms(a, k_small[f"fp64_{i}"]) for i, a in enumerate(mine)),
                "per_output_vs_fp64": {
                    n: rel_rms(a, k_small[f"fp64_{i}"]) for i, (n, a) in enumerate(zip(names, mine))
                },
            }
        errors["fla"] = {"vs_fp64": max(rel_rms(a, k_small[f"fp64_{i}"]) for i, a in enumerate(fla_small))}
    fla_ms = {(r["B"], r["T"], r["mode"]): r["ms"] for r in fla["rows"]}
    rows = []
    for r in fla["rows"] + kd["rows"]:
        bwd = r["mode"] == "fwd+bwd"
        ms = r["ms"]
        fl, by = flops(r["B"], r["T"], H, K, V, backward=bwd), min_bytes(r["B"], r["T"], H, K, V, backward=bwd)
        r.update(
            tflops=fl / ms / 1e9 if ms else None,
            gbs=by / ms / 1e6 if ms else None,
            vs_fla=ms / fla_ms[r["B"], r["T"], r["mode"]] if ms else None,
        )
        rows.append(r)
    rows.sort(key=lambda r: (r["B"], r["T"], r["mode"], r["impl"]))
    meta = {"device": fla["device"], "jax": kd["jax"], "peak_tflops": fla["peak_tflops"], "copy_gbs": fla["copy_gbs"]}
    profiles = {"fla": fla.get("profile"), "kdax pallas_gpu": kd.get("profile")}
    small = dict(zip(("B", "T", "H"), SMALL))
    return {"meta": meta, "rows": rows, "errors": errors, "small_case": small, "profiles": profiles}


def format_profiles(res: dict, min_share: float = 0.01) -> list[str]:
    """Per implementation and pass: the kernels taking at least ``min_share`` of the device
    time (the rest summed in one row), against the timed ms of the same shape."""
    timed = {(r["impl"], r["B"], r["T"], r["mode"]): r["ms"] for r in res["rows"]}
    out = []
    for impl, prof in (res.get("profiles") or {}).items():
        for mode in (m for m in ("fwd", "fwd+bwd") if prof and m in prof):
            head = f"\n{impl} {mode}, B={prof['B']} T={prof['T']}, {prof['calls']} calls traced"
            if isinstance(prof[mode], str):
                out.append(f"{head}: the profile failed: {prof[mode]}")
                continue
            kernels = prof[mode]
            total = sum(r["us"] for r in kernels)
            ms = timed.get((impl, prof["B"], prof["T"], mode))
            out.append(
                f"{head}: {total / 1e3:.3f} ms of device time per call in {len(kernels)} kernels"
                + (f" ({ms:.3f} ms timed)" if ms else "")
            )
            out += ["| kernel | µs per call | launches per call | share |", "|---|---|---|---|"]
            shown = [r for r in kernels if r["us"] >= min_share * total]
            rest = kernels[len(shown) :]
            if rest:
                shown.append(
                    {
                        "kernel": f"other kernels ({len(rest)})",
                        "us": sum(r["us"] for r in rest),
                        "launches": sum(r["launches"] for r in rest),
                    }
                )
            for r in shown:
                name = r["kernel"].replace("|", "/")
                name = name if len(name) <= 80 else name[:77] + "..."
                out.append(f"| {name} | {r['us']:.1f} | {r['launches']:g} | {100 * r['us'] / total:.0f}% |")
    return out


def format_compare(res: dict) -> str:
    m = res["meta"]
    pk, bw = m["peak_tflops"], m["copy_gbs"]
    out = [f"# {m['device']}: measured bf16 matmul {pk:.0f} TFLOP/s, copy {bw:.0f} GB/s; H={H} K=V={K} bf16"]
    out.append("| B | T | pass | impl | median ms (IQR) | TFLOP/s (% peak) | GB/s (% copy) | time / FLA | compile s |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        compile_s = f"{r['compile_s']:.1f}" if r.get("compile_s") else ""
        if r["ms"] is None:
            out.append(
                f"| {r['B']} | {r['T']} | {r['mode']} | {r['impl']} | failed: {r.get('error')} | | | | {compile_s} |"
            )
            continue
        out.append(
            f"| {r['B']} | {r['T']} | {r['mode']} | {r['impl']} | {r['ms']:.3f} ({r['q25']:.3f}-{r['q75']:.3f}) "
            f"| {r['tflops']:.1f} ({100 * r['tflops'] / pk:.0f}%) | {r['gbs']:.0f} ({100 * r['gbs'] / bw:.0f}%) "
            f"| {r['vs_fla']:.2f} | {compile_s} |"
        )
    s = res["small_case"]
    out.append(f"\nmax rel. error over o and every gradient, B={s['B']} T={s['T']} H={s['H']} bf16:")
    for name, e in res["errors"].items():
        fla = f"vs FLA {e['vs_fla']:.2e}, " if "vs_fla" in e else ""
        out.append(f"  {name}: {fla}vs fp64 reference {e['vs_fp64']:.2e}")
    return "\n".join(out + format_profiles(res))


def main(argv):
    p = argparse.ArgumentParser(prog="python -m kdax.bench.fla_compare")
    p.add_argument("worker")
    p.add_argument("impl", choices=["fla", "kdax"])
    p.add_argument("out")
    p.add_argument("repeats", type=int)
    p.add_argument("shapes")
    ns = p.parse_args(argv)
    shapes = [tuple(s) for s in json.loads(ns.shapes)]
    run = _fla_worker if ns.impl == "fla" else _kdax_worker
    _save(run(shapes, ns.repeats, ns.out), ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def register(sub) -> None:
    """``kdax bench gpu-compare``."""
    p = flags.command(
        sub,
        "gpu-compare",
        _command,
        "on a CUDA GPU: kdax pallas_gpu and xla against FLA's chunk_kda (separate processes)",
    )
    p.add_argument("--shapes", type=flags.pairs, default=SHAPES, help="BxT,... (H=16, K=V=128 bf16)")
    p.add_argument("--workdir", help="keep the workers' results here")
    p.add_argument("--python", default=sys.executable, help="python that runs the workers (FLA and kdax)")
    flags.output(p, repeats=20)


def _command(ns, parser) -> int:  # the workers use the GPU; this process need not
    result = compare(ns.shapes, ns.repeats, python=ns.python, workdir=ns.workdir)
    m = flags.meta(ns, device=False)  # the workers' jax and device stand
    result["meta"].update(date=m["date"], command=m["command"])
    print(json.dumps(result, indent=2) if ns.json else format_compare(result))
    return 0
