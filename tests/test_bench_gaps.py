"""bench/gaps.py: idle time between compute kernels of a profiled step."""

from bench.gaps import compute_gaps, gap_report


def test_gaps_merge_overlapping_kernels_and_skip_communication():
    kernels = [(0, 100, "gemm"), (50, 120, "gemm2"), (130, 900, "ncclDevKernel_SendRecv"),
               (300, 400, "attn"), (390, 395, "add"), (1000, 1010, "norm"), (1020, 1030, "tiny gap before")]
    span, busy, gaps = compute_gaps(kernels)
    assert span == 1030 and busy == 120 + 100 + 10 + 10
    assert [(g.start_us, g.length_us, g.before, g.after) for g in gaps] == [
        (400, 600, "attn", "norm"), (120, 180, "gemm2", "attn")]  # the 10 us gap is below 50 us
    assert "0.600 ms idle after 'attn'" in gap_report(kernels)


def test_no_kernels_reports_zero():
    assert compute_gaps([]) == (0.0, 0.0, [])
    assert gap_report([]).startswith("compute kernels: span 0.00 ms")
