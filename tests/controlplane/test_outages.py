"""The controllers' loops tell a database outage once, and its end, not every pass."""

from __future__ import annotations

import logging

import pytest
from django.db import OperationalError

from controlplane.outages import DatabaseOutage


def test_an_outage_is_logged_when_it_begins_and_ends_and_other_errors_in_full(
        caplog: pytest.LogCaptureFixture) -> None:
    outage = DatabaseOutage("reconcile", logging.getLogger("tests.outages"))
    with caplog.at_level(logging.WARNING, logger="tests.outages"):
        for _ in range(5):
            outage.failed(OperationalError("connection refused"))
        outage.succeeded()
        outage.succeeded()
        outage.failed(ValueError("a bug"))
    assert [r.getMessage() for r in caplog.records] == [
        "reconcile paused: the database does not answer (connection refused); trying "
        "again every pass",
        "reconcile resumed: the database answers again",
        "reconcile pass failed"]
    assert caplog.records[-1].exc_info is not None
