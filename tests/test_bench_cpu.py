"""The CPU figure the gateway benchmarks judge by (bench/path_figures.py): each thread's
time on a CPU by the scheduler's count, not psutil's 10 ms ticks, and the ticks where a
thread's count cannot be trusted. Measured on a process of its own, whose threads are
only the ones each case makes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from bench.path_figures import CpuReading, Endpoint

# Spins for the thread time asked on each line (in a thread of its own with "thread"),
# then prints the process's CPU time that took.
SPINNER = """
import sys, threading, time
def spin(seconds):
    started = time.thread_time()
    while time.thread_time() - started < seconds:
        pass
print("ready", flush=True)
for line in sys.stdin:
    seconds, where = line.split()
    started = time.process_time()
    if where == "thread":
        worker = threading.Thread(target=spin, args=(float(seconds),))
        worker.start()
        worker.join()
    else:
        spin(float(seconds))
    print(time.process_time() - started, flush=True)
"""


def start_spinner() -> subprocess.Popen[str]:
    """A SPINNER process, ready for its first line."""
    process = subprocess.Popen([sys.executable, "-c", SPINNER], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    return process


@pytest.fixture
def spinner() -> Iterator[subprocess.Popen[str]]:
    process = start_spinner()
    yield process
    process.kill()
    process.wait(timeout=10)


def spin(process: subprocess.Popen[str], seconds: float, where: str) -> tuple[float, float]:
    """CPU seconds the benchmark counts for one spin of `process`, and what it says."""
    assert process.stdin is not None and process.stdout is not None
    endpoint = Endpoint("spinner", {}, None, {"model": process.pid})
    before = endpoint.cpu_reading("model")
    process.stdin.write(f"{seconds} {where}\n")
    process.stdin.flush()
    said = float(process.stdout.readline())
    return endpoint.cpu_reading("model").since(before), said


def test_a_process_cpu_is_counted_to_well_under_a_tick(
        spinner: subprocess.Popen[str]) -> None:
    counted, said = spin(spinner, 0.013, "main")  # not a whole number of 10 ms ticks
    assert abs(counted - said) < 0.002


def test_a_thread_that_came_and_went_is_not_left_out(spinner: subprocess.Popen[str]) -> None:
    counted, said = spin(spinner, 0.06, "thread")  # its count went with it: the ticks
    assert abs(counted - said) < 0.025


def test_a_thread_gone_or_a_count_gone_back_falls_back_to_the_ticks() -> None:
    before = CpuReading(1.0, {(1, 1): 500_000_000, (1, 2): 100_000_000})
    assert CpuReading(1.5, {(1, 1): 900_000_000, (1, 2): 150_000_000,
                            (1, 3): 50_000_000}).since(before) == 0.5  # 0.4 + 0.05 + 0.05
    assert abs(CpuReading(1.2, {(1, 1): 900_000_000}).since(before)
               - 0.2) < 1e-9  # thread 2 ended
    assert abs(CpuReading(1.3, {(1, 1): 900_000_000, (1, 2): 10}).since(before)
               - 0.3) < 1e-9  # thread 2's number is another thread's now
    assert CpuReading(0.0, {}).since(CpuReading(0.0, {})) == 0.0


def test_the_wait_for_a_cpu_is_counted_while_another_process_holds_it(
        spinner: subprocess.Popen[str]) -> None:
    """Two spinners on one CPU: the measured one waits about as long as it runs."""
    rival = start_spinner()
    try:
        assert rival.stdin is not None
        cpu = min(os.sched_getaffinity(0))
        for process in (spinner, rival):
            os.sched_setaffinity(process.pid, {cpu})
        rival.stdin.write("5 main\n")  # spins on while the measured one does
        rival.stdin.flush()
        endpoint = Endpoint("spinner", {}, None, {"model": spinner.pid})
        before = endpoint.cpu_reading("model")
        counted, said = spin(spinner, 0.1, "main")
        waited = endpoint.cpu_reading("model").waited_since(before)
        assert waited is not None and waited > 0.04, waited
        assert abs(counted - said) < 0.002
    finally:
        rival.kill()
        rival.wait(timeout=10)


def test_the_wait_is_unknown_when_a_thread_is_gone_or_went_back() -> None:
    before = CpuReading(1.0, {(1, 1): 5, (1, 2): 5}, 1, {(1, 1): 100, (1, 2): 200})
    waited = CpuReading(1.5, {(1, 1): 9, (1, 2): 9, (1, 3): 1}, 1,
                        {(1, 1): 400, (1, 2): 200, (1, 3): 50}).waited_since(before)
    assert waited is not None and abs(waited - 350e-9) < 1e-15  # 300 + 0 + 50 ns
    assert CpuReading(1.2, {(1, 1): 9}, 1, {(1, 1): 400}).waited_since(before) is None
    assert CpuReading(1.2, {(1, 1): 9, (1, 2): 9}, 1,
                      {(1, 1): 400, (1, 2): 10}).waited_since(before) is None
    assert CpuReading(0.0, {}).waited_since(CpuReading(0.0, {})) is None


@pytest.mark.parametrize(("arguments", "error"), [
    (["--other-python", sys.executable], "--other-python goes with --compare-with"),
    (["--compare-with", ".", "--other-python", "/no/such/python"],
     "--other-python /no/such/python: not an executable file"),
    (["--compare-with", ".", "--other-python", "/tmp"],
     "--other-python /tmp: not an executable file"),
    (["--profile-rate", "1000"], "--profile-rate goes with --profile"),
    (["--profile", "/tmp/p.txt", "--profile-rate", "0"], "--profile-rate takes 1 to 10000"),
    (["--profile", "/tmp/p.txt", "--profile-rate", "20000"], "--profile-rate takes 1 to 10000"),
    (["--other-env", "HEALTH_CHECK_SECONDS=30"], "--other-env goes with --compare-with"),
    (["--compare-with", ".", "--other-env", "HEALTH_CHECK_SECONDS"],
     "--other-env 'HEALTH_CHECK_SECONDS': takes NAME=VALUE"),
    (["--compare-with", ".", "--other-env", "health_check_seconds=30"],
     "--other-env 'health_check_seconds=30': takes NAME=VALUE"),
    (["--compare-with", ".", "--other-env", "A=1", "--other-env", "A=2"],
     "--other-env A is given twice"),
    (["--env", "LOG_LEVEL"], "--env 'LOG_LEVEL': takes NAME=VALUE"),
])
def test_the_benchmark_refuses_arguments_it_cannot_use(arguments: list[str],
                                                       error: str) -> None:
    from tests.processes import ROOT

    done = subprocess.run([sys.executable, "bench/gateway_overhead.py", *arguments],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert error in done.stderr


def test_a_setting_for_the_other_side_reaches_only_its_control_plane(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from bench import gateway_compare

    seen: list[list[dict[str, str]]] = []
    monkeypatch.setattr(gateway_compare, "compare_two",
                        lambda options, root, envs, pythons: seen.append(envs))
    options = argparse.Namespace(compare_with=".", local=False, redis=False,
                                 other_env={"HEALTH_CHECK_SECONDS": "30"})
    gateway_compare.compare_checkouts(options, {"LOG_LEVEL": "INFO"})
    assert seen == [[{"LOG_LEVEL": "INFO"},
                     {"LOG_LEVEL": "INFO", "HEALTH_CHECK_SECONDS": "30"}]]


def test_each_round_begins_one_path_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """No path is always the one after a given other: over as many rounds as paths,
    each takes each place in the order once, and each path's runs are its own."""
    from bench import path_figures
    from bench.stream_load import Run

    sent: list[str] = []

    async def one_load(url: str, model: str, streams: int, tokens: int, key: str | None,
                       requests: int) -> Run:
        sent.append(url)
        return Run([0.01], ord(url), 1.0, 0)

    monkeypatch.setattr(path_figures, "load", one_load)
    endpoints = [path_figures.Endpoint(name, {"fake": name}, None, {}) for name in "ABC"]
    sides = path_figures.interleave(path_figures.LOADS["paced-1"], endpoints, 4)
    assert "".join(sent) == "ABC" + "ABC" + "BCA" + "CAB" + "ABC"  # warm-ups, then rounds
    assert [[run.tokens for run in side.runs] for side in sides] == [
        [ord(name)] * 4 for name in "ABC"]


def test_the_vllm_rows_go_through_the_same_rotated_rounds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`--vllm`'s direct-against-gateway rows are measured as every other load is."""
    from bench import gateway_overhead, path_figures
    from bench.stream_load import Run

    sent: list[str] = []

    async def one_load(url: str, model: str, streams: int, tokens: int, key: str | None,
                       requests: int) -> Run:
        sent.append(url)
        return Run([0.01 if url == "d" else 0.02], tokens, 1.0, 0)

    monkeypatch.setattr(path_figures, "load", one_load)
    direct, through = gateway_overhead.compare("vLLM", "d", "g", "smollm2", 1, 128, "k", 2)
    assert "".join(sent) == "dg" + "dg" + "gd"  # warm-ups, then two rounds
    assert through.ttft(0.5) - direct.ttft(0.5) == pytest.approx(10.0)
    assert direct.events == through.events == 256


def test_the_soak_refuses_a_malformed_setting() -> None:
    from tests.processes import ROOT

    done = subprocess.run([sys.executable, "bench/soak.py", "--env", "SCRAPE_INTERVAL"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--env 'SCRAPE_INTERVAL': takes NAME=VALUE" in done.stderr
