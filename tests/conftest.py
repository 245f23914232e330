"""Test configuration: float64 on, so the references can run as the gold standard; XLA's CPU
backend tuned to compile fast (the suite compiles thousands of small programs and runs each a few
times; subprocesses inherit the flags): without LLVM's optimisation passes (a third off the suite's
time) and with the loop emitters instead of the newer fusion emitters (measured: 40% less compile
time on the Pallas interpreter's programs, 37% on a hybrid model's)."""

import os

for name, value in (("xla_backend_optimization_level", "0"), ("xla_cpu_use_fusion_emitters", "false")):
    if name not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{name}={value}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from kdax.ops.kda import api  # noqa: E402

jax.config.update("jax_enable_x64", True)


@pytest.fixture(autouse=True)
def _fresh_compiled_ops(request):
    """The public ops are compiled once per shape and static option: a test that patches
    kdax's internals (or what they read, e.g. the default device) must neither meet ops
    compiled before its patch nor leave its own behind."""
    if "monkeypatch" not in request.fixturenames:
        yield
        return
    api._compiled.clear_cache()
    yield
    api._compiled.clear_cache()


MAPS_LIMIT = 30_000  # of Linux's vm.max_map_count, 65,530 by default


@pytest.fixture(autouse=True)
def _bounded_code_maps():
    """Each program XLA compiles keeps its machine code in a few memory maps, and the Pallas
    interpreter compiles thousands a test: a worker past Linux's map limit aborts inside XLA's
    compiler. Once a worker holds MAPS_LIMIT maps, jax's caches are cleared (their code unmapped)."""
    yield
    try:
        with open("/proc/self/maps") as f:
            maps = sum(1 for _ in f)
    except OSError:  # not Linux
        return
    if maps > MAPS_LIMIT:
        jax.clear_caches()


def pytest_runtest_logreport(report):
    """With KDAX_FAILURE_LOG set, each failure's report is appended to that file as it happens
    (by the xdist controller, not its workers), so a run cut short by a time limit still shows
    why tests failed."""
    path = os.environ.get("KDAX_FAILURE_LOG")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as f:
            f.write(f"\n==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


# The modules of the longest tests (tests/multidevice's single test takes minutes), run first: with
# --dist loadscope a module is one unit of work, and the longest units first leave no long one for
# the end, when the other worker has nothing left to do.
LONGEST_FIRST = (
    "tests/multidevice/test_mesh.py",
    "tests/ops/kda/test_chunk.py",
    "tests/ops/kascade/test_pallas.py",
    "tests/models/test_hf_parity.py",
    "tests/integrations/test_vllm_step.py",
)


def pytest_collection_modifyitems(config, items):
    """Order the collected tests: :data:`LONGEST_FIRST`'s modules first, the rest as collected."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
