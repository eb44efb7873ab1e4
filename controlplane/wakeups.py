"""Wake-ups for the controllers: a change asks for a reconcile pass now instead of at the
next interval; the collector's pass tells the autoscaler that new figures are in.

A leaf module (it imports nothing of controlplane/, only the leaf serving/wakeup.py), so
that services, backends and the controllers' loop can all import it at the top without an
import circle.
"""

from __future__ import annotations

from serving.wakeup import Wakeup

#: Set when a pass is wanted now; cleared by the controllers' loop as a pass starts. The
#: loop waits on it (`wait_async`) between passes, woken at once by `set()`.
reconcile_requested = Wakeup()

#: Set by the collector when a pass has ended (its figures are in the store); the
#: autoscaler waits on it, so a decision reads the figures of the pass just made.
figures_collected = Wakeup()


def request_reconcile() -> None:
    """Ask for a pass now (in this process; other processes notice within one interval)."""
    reconcile_requested.set()
