"""The CPU figure the gateway benchmarks judge by (bench/path_figures.py): each thread's
time on a CPU by the scheduler's count, not psutil's 10 ms ticks, and the ticks where a
thread's count cannot be trusted."""

from __future__ import annotations

import os
import threading
import time

from bench.path_figures import CpuReading, Endpoint

ME = Endpoint("this process", {}, None, {"model": os.getpid()})


def spin(seconds: float) -> None:
    started = time.thread_time()
    while time.thread_time() - started < seconds:
        pass


def test_a_process_cpu_is_counted_to_well_under_a_tick() -> None:
    before, started = ME.cpu_reading("model"), time.process_time()
    spin(0.013)  # not a whole number of 10 ms ticks
    spent = ME.cpu_reading("model").since(before)
    assert abs(spent - (time.process_time() - started)) < 0.002


def test_a_thread_that_came_and_went_is_not_left_out() -> None:
    before, started = ME.cpu_reading("model"), time.process_time()
    worker = threading.Thread(target=spin, args=(0.06,))
    worker.start()
    worker.join()  # its count went with it: the ticks are taken, to within their rounding
    spent = ME.cpu_reading("model").since(before)
    assert abs(spent - (time.process_time() - started)) < 0.025


def test_a_thread_gone_or_a_count_gone_back_falls_back_to_the_ticks() -> None:
    before = CpuReading(1.0, {(1, 1): 500_000_000, (1, 2): 100_000_000})
    assert CpuReading(1.5, {(1, 1): 900_000_000, (1, 2): 150_000_000,
                            (1, 3): 50_000_000}).since(before) == 0.5  # 0.4 + 0.05 + 0.05
    assert abs(CpuReading(1.2, {(1, 1): 900_000_000}).since(before)
               - 0.2) < 1e-9  # thread 2 ended
    assert abs(CpuReading(1.3, {(1, 1): 900_000_000, (1, 2): 10}).since(before)
               - 0.3) < 1e-9  # thread 2's number is another thread's now
    assert CpuReading(0.0, {}).since(CpuReading(0.0, {})) == 0.0
