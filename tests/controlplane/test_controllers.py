"""The controllers' runner (controlplane/controllers.py): what a pass in a worker thread
leaves behind on that thread, and the loop between passes: asleep until the interval ends
or a pass is asked for, woken at once by a request from another thread."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from django.db import connection

from controlplane import controllers
from controlplane.controllers import _wait_for_next
from controlplane.reconciler import Reconciler
from controlplane.wakeups import reconcile_requested, request_reconcile
from tests.factories import make_deployment


@pytest.mark.django_db(transaction=True)
def test_a_pass_in_debug_leaves_no_query_log_on_its_thread(settings: Any) -> None:
    settings.DEBUG = True  # Django logs every query of a connection, up to 9,000
    make_deployment("demo")
    Reconciler().reconcile_all()
    assert len(connection.queries) > 0  # what a pass leaves without the runner
    controllers._one_pass(Reconciler())
    assert connection.queries == []


async def test_a_pass_asked_for_from_a_thread_ends_the_wait_at_once() -> None:
    reconcile_requested.clear()
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(
        0.05, lambda: threading.Thread(target=request_reconcile).start())
    started = time.monotonic()
    await _wait_for_next(stop, 60.0)
    # Long before the interval (a loose bound: the machine may be busy).
    assert time.monotonic() - started < 10.0
    assert reconcile_requested.is_set()
    reconcile_requested.clear()


async def test_with_nothing_asked_the_wait_lasts_the_interval() -> None:
    reconcile_requested.clear()
    started = time.monotonic()
    await _wait_for_next(asyncio.Event(), 0.2)
    assert time.monotonic() - started >= 0.19
    assert not reconcile_requested.is_set()


async def test_stopping_ends_the_wait() -> None:
    reconcile_requested.clear()
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, stop.set)
    started = time.monotonic()
    await _wait_for_next(stop, 60.0)
    assert time.monotonic() - started < 10.0
