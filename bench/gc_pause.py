"""How long a full collection of Python's cycle collector stalls the server's event loop,
with what the server starts with (Django, its apps, the ASGI application, the gateway and
the controllers' modules) left to be scanned, and frozen as `manage.py serve` freezes it
once serving (controlplane/management/commands/serve.py, freeze_startup_objects).

Full collections come now and then as answers end (the objects a request leaves reach
the oldest generation); each one scans every tracked object, and the event loop waits.
Measured in this process after loading what `serve` loads, in interleaved rounds (not
frozen, frozen, not frozen, ...), plus a stand-in for what requests leave behind (a few
thousand small dicts and lists, as the route table, metrics children and pools hold).

    .venv/bin/python bench/gc_pause.py [--rounds 5]

The last line is the median stall of a full collection, not frozen and frozen; the line
before it, the stall of one collection of the youngest generation at the threshold serve
sets once serving (SERVING_GC_THRESHOLDS).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def load_server() -> None:
    """What `manage.py serve` has loaded by the time it serves."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    os.environ.setdefault("DEBUG", "true")  # the development run's settings (`make run`)
    import django

    django.setup()
    import uvicorn  # noqa: F401

    import controlplane.asgi
    import controlplane.controllers
    import controlplane.http_protocol  # noqa: F401
    import serving.gateway.app  # noqa: F401


def full_collection_ms() -> float:
    started = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - started) * 1000


def young_collection_ms(rounds: int, threshold: int) -> float:
    """The stall of one collection of the youngest generation when it holds `threshold`
    new containers (as many as serve lets it), shaped like a request's objects (dicts of
    lists and strings), all still in use; the median of `rounds`."""
    stalls = []
    for _ in range(rounds):
        gc.collect()
        gc.disable()  # none of them scanned before the one measured
        per_request = 4  # containers per entry below: dict, list, dict, list
        live = [{"headers": [(b"a", b"b")], "state": {"n": i, "chunks": [str(i)]}}
                for i in range(threshold // per_request)]
        started = time.perf_counter()
        gc.collect(0)
        stalls.append((time.perf_counter() - started) * 1000)
        gc.enable()
        del live
    return statistics.median(stalls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    load_server()
    from controlplane.management.commands.serve import SERVING_GC_THRESHOLDS
    gc.collect()
    tracked = len(gc.get_objects())
    plain: list[float] = []
    frozen: list[float] = []
    left: list[object] = []
    for _ in range(options.rounds):
        gc.unfreeze()
        plain.append(full_collection_ms())
        gc.freeze()  # as serve does once serving
        # What requests leave is made after the freeze and stays scanned.
        left = [{"n": i, "items": [i, str(i)]} for i in range(5000)]
        frozen.append(full_collection_ms())
    del left
    young = young_collection_ms(options.rounds, SERVING_GC_THRESHOLDS[0])
    gc.unfreeze()
    print(f"objects the collector tracks with the server loaded: {tracked:,}")
    print(f"full collection, every round (ms): not frozen {[round(x, 1) for x in plain]}; "
          f"frozen {[round(x, 2) for x in frozen]}")
    print(f"young collection at serve's threshold ({SERVING_GC_THRESHOLDS[0]:,} new "
          f"containers, request-like), median of {options.rounds}: {young:.2f} ms")
    print(f"full collection stall, median of {options.rounds}: not frozen "
          f"{statistics.median(plain):.1f} ms, frozen {statistics.median(frozen):.2f} ms")


if __name__ == "__main__":
    main()
