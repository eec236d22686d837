import math
import time

import pytest
import torch

from autofp4.timing import (
    TimingStats,
    copies_for_cold_l2,
    faster_beyond_noise,
    stats_from_samples,
    time_cpu,
    time_cuda,
)


def test_stats_hand_computed():
    st = stats_from_samples([5.0, 1.0, 4.0, 2.0, 3.0])
    assert st.median_us == 3.0
    # p25 = 2, p75 = 4 (linear interpolation on 5 points) -> spread = 1
    assert st.spread_us == pytest.approx(1.0)
    assert st.min_us == 1.0 and st.samples == 5
    assert st.raw == (5.0, 1.0, 4.0, 2.0, 3.0)
    st4 = stats_from_samples([10.0, 20.0, 30.0, 40.0])
    # p25 at position 0.75 -> 17.5, p75 at 2.25 -> 32.5, spread 7.5; median 25
    assert st4.median_us == 25.0 and st4.spread_us == pytest.approx(7.5)
    with pytest.raises(ValueError):
        stats_from_samples([])
    with pytest.raises(ValueError):
        stats_from_samples([1.0, float("nan")])


def test_time_cpu_sleep_within_bounds():
    delay = 0.01
    st = time_cpu(lambda: time.sleep(delay), [()], warmup=1, reps=5)
    assert st.samples == 5 and len(st.raw) == 5
    # sleep never returns early; a loaded 2-core machine may add a lot, so the bound is generous
    assert delay * 1e6 <= st.min_us <= st.median_us < 8 * delay * 1e6
    assert 0.0 <= st.spread_us < 4 * delay * 1e6
    assert math.isclose(st.median_us, sorted(st.raw)[2])


def test_time_cpu_rotates_arguments():
    seen = []
    args = [(i,) for i in range(3)]
    time_cpu(lambda i: seen.append(i), args, warmup=2, reps=7)
    assert seen == [0, 1] + [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(ValueError):
        time_cpu(lambda: None, [], reps=1)
    with pytest.raises(ValueError):
        time_cpu(lambda: None, [()], reps=0)


def test_faster_beyond_noise():
    a = TimingStats(10.0, 1.0, 9, 9.0)
    b = TimingStats(13.0, 1.0, 9, 12.0)
    assert faster_beyond_noise(a, b)  # 11 < 12
    assert not faster_beyond_noise(b, a)
    c = TimingStats(11.5, 1.0, 9, 11.0)  # 11 < 10.5 is false: intervals overlap
    assert not faster_beyond_noise(a, c)
    assert not faster_beyond_noise(a, a)
    assert faster_beyond_noise(a, b, min_gain=0.2)  # 10 <= 0.8 * 13
    assert not faster_beyond_noise(a, b, min_gain=0.3)


def test_copies_for_cold_l2():
    l2 = 50 * 2**20
    per = 10 * 2**20
    n = copies_for_cold_l2(per, l2)
    assert n * per > 2 * l2 and (n - 1) * per <= 2 * l2
    assert copies_for_cold_l2(300 * 2**20, l2) == 1
    assert copies_for_cold_l2(1, l2, max_copies=8) == 8
    assert copies_for_cold_l2(per, 0) == 1
    with pytest.raises(ValueError):
        copies_for_cold_l2(0, l2)


@pytest.mark.gpu
@pytest.mark.parametrize("use_graph", [False, True])
def test_time_cuda_matmul(use_graph, gen):
    dev = torch.device("cuda")
    a = [torch.randn(2048, 2048, generator=gen).to(dev, torch.bfloat16) for _ in range(4)]
    out = torch.empty(2048, 2048, device=dev, dtype=torch.bfloat16)

    def fn(x):
        torch.matmul(x, x, out=out)

    st = time_cuda(fn, [(x,) for x in a], warmup=3, reps=10, use_graph=use_graph)
    # 2 * 2048^3 flop: slower than 1 PFLOP/s and faster than 1 TFLOP/s on any current GPU
    assert 2 * 2048**3 / 1e15 * 1e6 < st.median_us < 2 * 2048**3 / 1e12 * 1e6
    assert st.samples == 10 and st.spread_us >= 0
