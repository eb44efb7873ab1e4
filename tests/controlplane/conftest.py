from collections.abc import Iterator

import pytest

from controlplane.backends.base import close_backends
from serving.routes import build_table, routes
from tests.engines import fake_engines  # noqa: F401  (a fixture shared with tests/serving)
from tests.k8s_emulator import EmulatedCluster
from tests.serving.conftest import (  # noqa: F401  (the server in this process)
    gateway_url,
    usage_written_before_the_database_is_emptied,
)


@pytest.fixture(autouse=True, scope="module")
def no_route_table_between_modules() -> Iterator[None]:
    """Each module starts and ends with an empty route table: the session's in-process
    gateway (`gateway_url`) keeps the last table it was handed, and its load watcher
    would go on scraping the replicas an earlier module left in it, whose ports later
    tests' listeners may have taken."""
    routes.publish(build_table([]))
    yield
    routes.publish(build_table([]))


@pytest.fixture
def emulated() -> Iterator[EmulatedCluster]:
    """The STAND-IN Kubernetes API server (kmock), for the Kubernetes backend's tests."""
    cluster = EmulatedCluster().start()
    yield cluster
    close_backends()  # their pod watches end before the server does
    cluster.stop()
