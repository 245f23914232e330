"""Static cycles of TPU programs from their LLO bundle listings, as libtpu dumps them
(``--xla_jf_dump_llo_text``): each bundle weighted by the trip counts of the loops around it
(Mosaic's exit tests, branch predicates, XLA's while latches), the DMA bytes waited for, the
scoped VMEM of each Mosaic kernel, and the programs a listing calls. Used by
scripts/tpu_compile_report.py and scripts/vllm_tpu_scale.py; tested on hand-written listings
(tests/test_tpu_compile_report.py). Static cycles count no memory stalls and take predicated
regions as executed: compare like with like, not with wall time."""

from __future__ import annotations

import dataclasses
import os
import re

KERNEL_PREFIXES = ("kda_", "kascade_", "mla_")  # every pallas_call kdax names for TPU

_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(?:(?:LH|LB|LE|PB|PF|CT):\s*)?[:>]")
_REGION = re.compile(r"Start region (\d+)")
_BRANCH = re.compile(r"sbr\.rel \(([^)]*)\) target (?:bundleno = (\d+)|= \$region(\d+))")
# a branch's predicate defined by a compare of a counter with a constant: %p = scmp.ge %s, N
_COMPARE = re.compile(r"(%p\w+) = scmp\.(ge|lt|ne)\.s32\.totalorder (%s\w+), (\d+)")
_TRUE = re.compile(r"(%p\w+) = pmov 1 ")  # a constant predicate: a back branch on !%p is never taken
_EXIT = re.compile(r"scmp\.\w+\.s32\.totalorder (%s\w+), (\d+) /\* loop exit test \*/")
_STEP = re.compile(r"(%s\w+) = sadd\.s32 (\d+), %s\w+")  # an induction variable's increment
_LATCH = re.compile(r"scmp\.(?:lt|ne)\.s32\.totalorder %s\w+, (\d+)(?! /\*)")  # XLA's while loops: i + 1 < N
_VMEM = re.compile(r"#allocation\d+ \[shape = '[^']*', space=vmem, size = (0x[0-9a-f]+)")
# a DMA's completion: dma.done.wait [(predicate),] flag, granules (an immediate, or a register: unknown)
_WAIT = re.compile(r"dma\.done\.wait (?:\([^)]*\), )?[^,]+, (\d+|%s\w+)")
GRANULE = 32  # bytes of a DMA granule, the unit of the listings' dma.done.wait counts


_CALL = re.compile(r"\b(?:inlined_)?call\b[^;{}]*?/\* (?:%([\w.\-]+) = |(<[\w-]+>))")


@dataclasses.dataclass
class Listing:
    """One program's bundles, counted: its own static cycles, loops of unknown trips, and the
    programs it calls with the weight (the trips of the loops around each call site)."""

    cycles: int
    unknown_loops: int
    calls: list  # [(callee name, weight, under a loop of unknown trips)]
    unknown_bodies: list  # per loop of unknown trips, the cycles of one trip (its bundles, weighted)
    dma_bytes: int = 0  # bytes of the DMAs it waits for, weighted as the cycles are
    unknown_dmas: int = 0  # waits of a size held in a register (not counted)
    unknown_body_bytes: list = dataclasses.field(default_factory=list)  # per loop of unknown_bodies, a trip's bytes


def static_cycles(text: str) -> Listing:
    """Count one program's bundle listing.

    A bundle is a line that starts with its address. A branch back to an earlier bundle (by
    number, or to a region whose start an earlier bundle marks) closes a loop; the loop's trip
    count is the constant of the loop-exit test inside it and outside its inner loops (Mosaic
    marks it), else of the compare with a constant in its last 8 bundles (XLA's while loops:
    ``i + 1 < N``); an unrolled loop's induction variable steps by more than one, which divides
    the trips. Each bundle counts the product of the trips of the loops around it; a loop
    with neither (a data-dependent bound) counts once, which makes the total a lower bound. A
    ``call`` bundle names the program it runs (XLA's top-level program calls each fusion and
    kernel), which :func:`read_dump` adds at the call site's weight.

    Bytes moved: each ``dma.done.wait`` names the granules it waits for, weighted like its bundle.
    The waits count what a program consumes, where the starts would not: a pipeline's first fetch
    and its prefetches are both predicated starts in the listing, of which one runs a step, and
    its wait is one. Local copies (VMEM to SMEM) count too; they are a few granules a step.
    """
    bundles, regions, branches, exits, latches, calls, steps, compares = [], {}, [], [], [], [], {}, {}
    waits = []  # (addr, granules or None)
    for line in text.splitlines():
        m = _BUNDLE.match(line)
        if not m:
            continue
        addr = int(m.group(1), 0)
        bundles.append(addr)
        for r in _REGION.findall(line):
            regions.setdefault(int(r), addr)
        for pred, by_number, region in _BRANCH.findall(line):
            branches.append((addr, int(by_number) if by_number else ("region", int(region)), pred))
        compares.update((p, (op, reg, int(n))) for p, op, reg, n in _COMPARE.findall(line))
        compares.update((p, ("true", None, 1)) for p in _TRUE.findall(line))
        exits += [(addr, reg, int(n)) for reg, n in _EXIT.findall(line)]
        steps.update((reg, int(n)) for reg, n in _STEP.findall(line))
        latches += [(addr, int(n)) for n in _LATCH.findall(line)]
        calls += [(addr, a or b) for a, b in _CALL.findall(line)]
        waits += [(addr, int(n) if n.isdigit() else None) for n in _WAIT.findall(line)]
    trips_of = lambda reg, n: -(-n // max(1, steps.get(reg, 1)))
    loops, conditions = [], {}
    for addr, target, pred in branches:
        start = regions.get(target[1]) if isinstance(target, tuple) else target
        if start is not None and start <= addr:
            loops.append([start, addr, None])
            conditions[(start, addr)] = pred
    loops.sort(key=lambda lp: lp[1] - lp[0])  # innermost first
    for addr, reg, n in exits:
        for lp in loops:
            if lp[0] <= addr <= lp[1]:
                lp[2] = lp[2] or trips_of(reg, n)
                break
    for lp in loops:
        # back while !(i >= N), i < N or i != N: N trips (Mosaic's copy loops carry no exit marker)
        pred = conditions[(lp[0], lp[1])]
        op, reg, n = compares.get(pred.lstrip("!"), (None, None, 0))
        if lp[2] is None and (op, pred.startswith("!")) in (("ge", True), ("lt", False), ("ne", False), ("true", True)):
            lp[2] = trips_of(reg, n)
        if lp[2] is None:
            lp[2] = next((n for addr, n in reversed(latches) if lp[1] - 8 <= addr <= lp[1]), None)

    def weight(addr):  # (product of the trips around addr, whether one of them is unknown)
        w, unknown = 1, False
        for start, end, trips in loops:
            if start <= addr <= end:
                w *= trips or 1
                unknown |= trips is None
        return w, unknown

    total = sum(weight(addr)[0] for addr in bundles)
    called = [(name, *weight(addr)) for addr, name in calls]
    unknown = sorted((s, e) for s, e, trips in loops if trips is None)  # in the listing's order
    bodies = [sum(weight(a)[0] for a in bundles if s <= a <= e) for s, e in unknown]
    sized = [(addr, n * GRANULE) for addr, n in waits if n is not None]
    body_bytes = [sum(weight(a)[0] * b for a, b in sized if s <= a <= e) for s, e in unknown]
    dma_bytes = sum(weight(a)[0] * b for a, b in sized)
    return Listing(total, len(bodies), called, bodies, dma_bytes, len(waits) - len(sized), body_bytes)


@dataclasses.dataclass
class Program:
    name: str
    cycles: int  # its own bundles, weighted by its loops, times the calls that run it
    unknown_loops: int
    unknown_bodies: list  # Listing.unknown_bodies times the calls that run it
    vmem: int  # bytes of VMEM allocations (Mosaic kernels)
    dma_bytes: int = 0  # Listing.dma_bytes times the calls that run it
    unknown_dmas: int = 0
    unknown_body_bytes: list = dataclasses.field(default_factory=list)


_HLO_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*?)\)(.*)$")
_HLO_NAME = re.compile(r"%([\w.\-]+)")


def hlo_signatures(text: str) -> dict:
    """{instruction: key} for the top-level computation of an HLO module's text, equal keys for
    instructions that compile to the same program: the opcode, the result's and operands' shapes
    and layouts, and the computations it calls with their names numbered by first use."""
    computations, body, shapes, entry = {}, None, {}, None
    for line in text.splitlines():
        if m := _HLO_COMPUTATION.match(line):
            body = computations[m.group(1)] = []
            entry = m.group(1) if line.startswith("ENTRY") else entry
        elif line.strip() == "}":
            body = None
        elif body is not None and (m := _HLO_INSTRUCTION.match(line.split(", metadata=")[0])):
            body.append(m.groups())
            shapes[m.group(1)] = m.group(2)

    def normal(name, seen=()):  # a computation's text, its names numbered, the computations it calls inlined
        numbers = {}

        def rename(m):
            callee = m.group(1)
            if callee in computations and callee not in seen and callee != name:
                return "{" + normal(callee, (*seen, name)) + "}"
            return "%" + str(numbers.setdefault(callee, len(numbers)))

        return ";".join(_HLO_NAME.sub(rename, " ".join((f"%{n}", *rest))) for n, *rest in computations[name])

    keys = {}
    for name, shape, op, operands, attrs in computations.get(entry, []):
        callees = [normal(c) for c in _HLO_NAME.findall(attrs) if c in computations]
        keys[name] = (shape, op, tuple(shapes.get(o) for o in _HLO_NAME.findall(operands)), tuple(callees))
    return keys


def read_dump(files: list[str]) -> list[Program]:
    """The programs of one compile's LLO dump files: per program its post-RA bundle listing
    (``*final_bundles.txt``) counted by :func:`static_cycles`, times the weight of the call sites
    that run it from the top-level program ("TLP"; once if none does), and its VMEM allocations
    (``*-original.txt``). XLA dumps one listing for instructions that compile to the same program
    (say the transposes of three gradients of one shape); a call of one without a listing runs
    the listing of its equal in the top-level HLO (``*-TLP-hlo.txt``, :func:`hlo_signatures`)."""
    final, original, keys = {}, {}, {}
    for path in files:
        if path.endswith("-TLP-hlo.txt"):
            with open(path, errors="replace") as f:
                keys = hlo_signatures(f.read())
        m = re.match(r"^\d+-(.+)-(\d+)-(final_bundles|original)\.txt$", os.path.basename(path))
        if m:
            (final if m.group(3) == "final_bundles" else original)[m.group(1)] = path
    listings = {}
    for name, path in final.items():
        with open(path, errors="replace") as f:
            listings[name] = static_cycles(f.read())
    same = {}  # signature -> the instruction whose listing was dumped
    for name in listings:
        if name in keys:
            same.setdefault(keys[name], name)
    runs = {}  # name -> (times run, whether under a loop of unknown trips)
    missing = []  # calls of programs with no listing and no equal: the total becomes a lower bound

    def visit(name, times, unknown):
        if name not in listings and name in keys:
            name = same.get(keys[name], name)
        if name not in listings:
            missing.append(name)
            return
        was = runs.get(name, (0, False))
        runs[name] = (was[0] + times, was[1] or unknown)
        for callee, w, u in listings[name].calls:
            visit(callee, times * w, unknown or u)

    visit("TLP", 1, False)
    out = []
    for name, listing in sorted(listings.items()):
        times, unknown = runs.get(name, (1, False))
        vmem = 0
        if name in original:
            with open(original[name], errors="replace") as f:
                vmem = sum(int(s, 16) for s in _VMEM.findall(f.read()))
        bodies = [b * times for b in listing.unknown_bodies]
        body_bytes = [b * times for b in listing.unknown_body_bytes]
        calls_missing = len(missing) if name == "TLP" else 0
        unknown_loops = listing.unknown_loops + unknown + calls_missing
        dmas = listing.dma_bytes * times
        out.append(
            Program(name, listing.cycles * times, unknown_loops, bodies, vmem, dmas, listing.unknown_dmas, body_bytes)
        )
    return out


def is_kernel(name: str) -> bool:
    return name.startswith(KERNEL_PREFIXES)
