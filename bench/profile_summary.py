"""Where a Python process's time goes, from py-spy's raw collapsed stacks
(`py-spy record --format raw --threads`, active samples only): each line is
`thread (TID): NAME;frame;frame ... COUNT`, a frame `function (path:line)`.

    .venv/bin/python bench/profile_summary.py PATH [SECONDS] [RATE] [--thread NAME]

With --thread (e.g. MainThread, the event loop's), only that thread's samples, each share
of them.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

# The project's own packages: a stack is charged to its deepest frame in one of them.
PROJECT = ("serving/", "controlplane/", "models_registry/", "access/", "fleetplane/")
FRAME = re.compile(r"^(?P<function>.*) \((?P<path>[^()]*?)(?::\d+)?\)$")


def parse(path: Path) -> list[tuple[str, list[str], int]]:
    """(thread name, frames from the outermost in, samples) per distinct stack."""
    stacks = []
    for line in path.read_text(encoding="utf-8").splitlines():
        head, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        thread, *frames = head.split(";")
        name = thread.split(": ", 1)[-1]
        stacks.append((re.sub(r"_\d+$|-\d+$", "", name), frames, int(count)))
    return stacks


def short(frame: str) -> str:
    """`function (path)` without the line number, the path cut to its last two parts."""
    match = FRAME.match(frame)
    if not match:
        return frame
    parts = match.group("path").split("/")
    return f"{match.group('function')} ({'/'.join(parts[-2:])})"


def package(frame: str) -> str:
    """The top-level package (or module) a frame's file belongs to."""
    match = FRAME.match(frame)
    if not match:
        return frame
    path = match.group("path")
    if "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    elif "/lib/python" in path:
        return "stdlib " + path.rsplit("/", 1)[-1].removesuffix(".py")
    return path.split("/", 1)[0].removesuffix(".py")


def owner(frames: list[str]) -> str:
    """The deepest frame of the project's own code on the stack."""
    for frame in reversed(frames):
        match = FRAME.match(frame)
        if match and match.group("path").startswith(PROJECT):
            return short(frame)
    return "(no project frame)"


def table(title: str, counts: Counter[str], total: int, top: int) -> list[str]:
    lines = [f"{title}:"]
    lines += [f"  {count / total:6.1%}  {key}" for key, count in counts.most_common(top)]
    return lines


def summarize_profile(path: Path, seconds: float | None = None, rate: int = 100,
                      top: int = 15, thread: str | None = None) -> str:
    """Active samples per thread (and its share of the wall time when `seconds` is given),
    then the leaf functions, their packages, the project code they run under and every
    function's inclusive share (the stages of a request, each with what it calls); with
    `thread`, that thread's samples only."""
    stacks = [stack for stack in parse(path) if thread is None or stack[0] == thread]
    total = sum(count for _, _, count in stacks) or 1
    threads: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    owners: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for thread, frames, count in stacks:
        threads[thread] += count
        leaf = frames[-1] if frames else "(no Python frame)"
        leaves[short(leaf)] += count
        packages[package(leaf)] += count
        owners[owner(frames)] += count
        for function in {short(frame) for frame in frames}:  # each once per stack
            inclusive[function] += count
    lines = [f"{total} active samples in {path}"]
    for thread, count in threads.most_common(top):
        busy = f", busy {count / (seconds * rate):.0%} of the time" if seconds else ""
        lines.append(f"  {count / total:6.1%}  thread {thread}{busy}")
    lines += table("leaf function (self time)", leaves, total, top)
    lines += table("leaf package", packages, total, top)
    lines += table("deepest project frame (inclusive)", owners, total, top)
    lines += table("every function (inclusive: the samples it is on the stack of)",
                   inclusive, total, 3 * top)
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("seconds", type=float, nargs="?")
    parser.add_argument("rate", type=int, nargs="?", default=100)
    parser.add_argument("--thread", help="one thread's samples only (its name)")
    options = parser.parse_args()
    print(summarize_profile(options.path, options.seconds, options.rate,
                            thread=options.thread))
