"""The route table the controllers hand the gateway, from the database."""

from __future__ import annotations

import pytest

from controlplane.routing import current_pools
from tests.factories import make_backend, make_deployment, make_model

pytestmark = pytest.mark.django_db


def test_the_routes_carry_the_models_task_and_whether_streams_report_usage_so_far() -> None:
    make_deployment("vectors", model=make_model("minilm", task="embed"))
    make_deployment("outside", backend=make_backend("elsewhere", kind="external",
                                                    config={"url": "http://x:1"}))
    pools = {pool.deployment: pool for pool in current_pools()}
    # vLLM replicas the control plane runs give the usage so far on every streamed chunk;
    # an external endpoint is not asked (it may refuse the option).
    assert (pools["vectors"].task, pools["vectors"].running_usage) == ("embed", True)
    assert (pools["outside"].task, pools["outside"].running_usage) == ("generate", False)
