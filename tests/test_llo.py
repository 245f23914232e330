"""kdax.bench.llo's static cycle count on hand-written LLO bundle listings: loop trip counts from
Mosaic's exit tests (unrolled loops step by more than one), from branch predicates (copy loops
carry no exit marker), the per-trip cycles of loops whose trips the code cannot see, programs
dumped once and called many times, and the bytes DMA waits move."""

from kdax.bench import llo


def listing(*bundles: str) -> str:
    return "\n".join(f"  {hex(i)}   : > {{ {b} }}" for i, b in enumerate(bundles))


def test_an_unrolled_loop_counts_its_trips_not_its_bound():
    text = listing(
        "%s1_s1 = smov.u32 0",
        "%s2_s2 = sphi %s1_s1, %s3_s2",  # 1: loop start, two bundles a trip
        "%s3_s2 = sadd.s32 8, %s2_s2 /* copy for cssa */  ;;  %p4_p0 = scmp.ge.s32.totalorder %s3_s2, 128 /* loop exit test */ ;; %5 = sbr.rel (!%p4_p0) target bundleno = 1",
        "%6 = vnop",
    )
    assert llo.static_cycles(text).cycles == 1 + 16 * 2 + 1


def test_a_copy_loop_takes_its_trips_from_the_branch_predicate():
    text = listing(
        "%s2_s2 = sadd.s32 1, %s9_s2  ;;  %p3_p1 = scmp.ge.s32.totalorder %s2_s2, 8",  # 0: loop start
        "%4 = sbr.rel (!%p3_p1) target bundleno = 0",
        "%p5_p2 = pmov 1 ",  # 2: a one-trip region closed by a branch that is never taken
        "%6 = sbr.rel (!%p5_p2) target bundleno = 2",
    )
    counted = llo.static_cycles(text)
    assert (counted.cycles, counted.unknown_loops) == (8 * 2 + 2, 0)


def test_a_loop_of_data_dependent_trips_counts_once_and_reports_a_trip():
    text = listing(
        "%s1_s1 = sld [smem:[#allocation2]]",
        "%s2_s2 = sadd.s32 1, %s9_s2",  # 1: outer loop of unknown trips
        "%s3_s3 = sadd.s32 1, %s8_s3  ;;  %p4_p1 = scmp.ge.s32.totalorder %s3_s3, 4 /* loop exit test */",  # 2: inner
        "%5 = sbr.rel (!%p4_p1) target bundleno = 2",
        "%p6_p2 = scmp.ge.s32.totalorder %s2_s2, %s1_s1  ;;  %7 = sbr.rel (!%p6_p2) target bundleno = 1",
    )
    counted = llo.static_cycles(text)
    assert (counted.cycles, counted.unknown_loops, counted.unknown_bodies) == (1 + 1 + 4 * 2 + 1, 1, [1 + 4 * 2 + 1])


def test_a_program_dumped_once_counts_at_every_call_of_an_equal_instruction(tmp_path):
    """XLA dumps one listing for instructions that compile to the same program: the transposes of
    two gradients of one shape both run copy.1's listing; a copy of another layout has none, which
    makes the total a lower bound."""
    hlo = """HloModule m
%fused_computation.2 (param_0.1: f32[8,128]) -> bf16[8,128] {
  %param_0.1 = f32[8,128]{1,0} parameter(0)
  ROOT %convert.3 = bf16[8,128]{1,0} convert(%param_0.1), metadata={op_name="a"}
}
%fused_computation.3 (param_0.2: f32[8,128]) -> bf16[8,128] {
  %param_0.2 = f32[8,128]{1,0} parameter(0)
  ROOT %convert.4 = bf16[8,128]{1,0} convert(%param_0.2), metadata={op_name="b"}
}
ENTRY %main (p0: f32[8,128], p1: f32[8,128]) -> (bf16[8,128], bf16[8,128]) {
  %p0 = f32[8,128]{1,0} parameter(0)
  %p1 = f32[8,128]{1,0} parameter(1)
  %fusion.1 = bf16[8,128]{1,0} fusion(%p0), kind=kLoop, calls=%fused_computation.2, metadata={op_name="c"}
  %fusion.2 = bf16[8,128]{1,0} fusion(%p1), kind=kLoop, calls=%fused_computation.3, metadata={op_name="d"}
  %copy.1 = bf16[8,128]{0,1} copy(%fusion.1), backend_config={"x":[]}
  %copy.2 = bf16[8,128]{0,1} copy(%fusion.2), backend_config={"x":[]}
  %copy.3 = bf16[8,128]{1,0} copy(%copy.2)
  ROOT %tuple = (bf16[8,128]{0,1}, bf16[8,128]{0,1}) tuple(%copy.1, %copy.3)
}
"""
    calls = [
        f"%{i} = inlined_call %s1 /* %{n} = {n.split('.')[0]}(%x) */"
        for i, n in enumerate(["fusion.1", "fusion.2", "copy.1", "copy.2", "copy.3"])
    ]
    files = {
        "1-TLP-hlo.txt": hlo,
        "2-TLP-02-final_bundles.txt": listing(*calls),
        "3-fusion.1-02-final_bundles.txt": listing("%1 = vnop", "%2 = vnop"),
        "4-copy.1-02-final_bundles.txt": listing(*["%1 = vnop"] * 10),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    programs = {p.name: (p.cycles, p.unknown_loops) for p in llo.read_dump([str(tmp_path / n) for n in files])}
    assert programs == {"TLP": (5, 1), "fusion.1": (2 * 2, 0), "copy.1": (2 * 10, 0)}  # copy.3: a lower bound


def test_dma_waits_count_the_bytes_a_loop_moves():
    """Each dma.done.wait names the granules (32 bytes) it waits for, weighted by the trips of the
    loops around it; a wait whose size sits in a register is counted apart (the bytes a lower bound)."""
    text = listing(
        "%1 = dma.done.wait [#allocation1], 16",  # once: 512 bytes
        "%s2_s2 = sadd.s32 1, %s9_s2",  # 1: a loop of 4 trips
        "%3 = dma.done.wait (%p1_p1), %s5_s5, 64 /* pipeline-emitter-dma-wait */",
        "%p4_p1 = scmp.ge.s32.totalorder %s2_s2, 4 /* loop exit test */ ;; %5 = sbr.rel (!%p4_p1) target bundleno = 1",
        "%6 = dma.done.wait %s7_s7, %s8_s8",
    )
    counted = llo.static_cycles(text)
    assert (counted.dma_bytes, counted.unknown_dmas) == (16 * 32 + 4 * 64 * 32, 1)
