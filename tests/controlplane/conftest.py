from collections.abc import Iterator

import pytest

from controlplane.backends.base import close_backends
from tests.engines import fake_engines  # noqa: F401  (a fixture shared with tests/serving)
from tests.k8s_emulator import EmulatedCluster
from tests.serving.conftest import (  # noqa: F401  (the server in this process)
    gateway_url,
    usage_written_before_the_database_is_emptied,
)


@pytest.fixture
def emulated() -> Iterator[EmulatedCluster]:
    """The STAND-IN Kubernetes API server (kmock), for the Kubernetes backend's tests."""
    cluster = EmulatedCluster().start()
    yield cluster
    close_backends()  # their pod watches end before the server does
    cluster.stop()
