"""The controllers' runner (controlplane/controllers.py): what a pass in a worker thread
leaves behind on that thread."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection

from controlplane import controllers
from controlplane.reconciler import Reconciler
from tests.factories import make_deployment

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_pass_in_debug_leaves_no_query_log_on_its_thread(settings: Any) -> None:
    settings.DEBUG = True  # Django logs every query of a connection, up to 9,000
    make_deployment("demo")
    Reconciler().reconcile_all()
    assert len(connection.queries) > 0  # what a pass leaves without the runner
    controllers._one_pass(Reconciler())
    assert connection.queries == []
