"""The served-stream profile's sorting of perf samples (bench/probes/served_profile.py), on lines as
`perf report --no-children -g none --sort dso,sym --stdio` printed them for a served int8 stream."""

import pytest

from bench.probes.served_profile import PLACES, place, split

REPORT = """\
# Samples: 23K of event 'cpu-clock'
#
# Overhead  Shared Object                            Symbol
# ........  .......................................  ......
#
    77.37%  libcorechat_kernels.so                   [.] corechat::(anonymous namespace)::tiles<0, 4, 1>
     7.38%  libgomp.so.1                             [.] 0x000000000001de62
     3.85%  libgomp.so.1                             [.] 0x000000000001e02a
     1.40%  [kernel.kallsyms]                        [k] pv_native_safe_halt
     0.78%  libpython3.11.so.1.0                     [.] _PyEval_EvalFrameDefault
     0.52%  libcorechat_kernels.so                   [.] corechat::quantize_rows
     0.50%  libcorechat_kernels.so                   [.] corechat::(anonymous namespace)::weigh_values<7, 2, 4>
     0.33%  libcorechat_kernels.so                   [.] corechat::(anonymous namespace)::score_keys<7, 3>
     0.30%  libcorechat_kernels.so                   [.] corechat::(anonymous namespace)::int4_row
     0.20%  libc.so.6                                [.] _int_free
     0.17%  libtorch_cpu.so                          [.] at::native::AVX2::direct_copy_kernel
     0.12%  [kernel.kallsyms]                        [k] _raw_spin_unlock_irqrestore
     0.05%  [unknown]                                [.] 0x00007f6503e1b4be
"""


def test_samples_are_summed_by_where_they_ran():
    shares = split(REPORT)
    assert list(shares) == PLACES
    assert shares["products"] == pytest.approx(77.37 + 0.30)
    assert shares["attention"] == pytest.approx(0.50 + 0.33)
    assert shares["corechat's other operators"] == pytest.approx(0.52)
    assert shares["OpenMP (waits, hand-offs)"] == pytest.approx(7.38 + 3.85)
    assert shares["idle"] == pytest.approx(1.40)
    assert shares["Linux kernel"] == pytest.approx(0.12)
    assert shares["Python interpreter"] == pytest.approx(0.78)
    assert shares["libc (malloc, copies)"] == pytest.approx(0.20)
    assert shares["torch (dispatch, other operators)"] == pytest.approx(0.17)
    assert shares["other"] == pytest.approx(0.05)
    assert sum(shares.values()) == pytest.approx(92.97)  # every line counted once


def test_an_empty_report_gives_zero_everywhere():
    assert split("# nothing sampled\n") == dict.fromkeys(PLACES, 0.0)


@pytest.mark.parametrize(("dso", "symbol", "expected"), [
    ("libcorechat_kernels.so", "corechat::matmul_avx2", "products"),
    ("libcorechat_kernels.so", "corechat::attend_avx512", "attention"),
    ("libcorechat_kernels.so", "corechat::(anonymous namespace)::write_rows", "attention"),
    ("libgomp-a34b3233.so.1", "gomp_barrier_wait_end", "OpenMP (waits, hand-offs)"),
    ("[kernel.kallsyms]", "do_idle", "idle"),
    ("[kernel.kallsyms]", "futex_wake", "Linux kernel"),
    ("libm.so.6", "expf", "libc (malloc, copies)"),
])
def test_each_place_is_told_by_its_object_and_symbol(dso, symbol, expected):
    assert place(dso, symbol) == expected
