"""Leader election through a Lease, against the STAND-IN API server (kmock): one holder at
a time, renewal, takeover once the holder stops renewing, a clean stop hands over at once,
and a holder that loses the Lease stops its controllers."""

from __future__ import annotations

import asyncio
import time

from controlplane.leader import LeaseElection
from tests.k8s_emulator import EmulatedCluster


def election(emulated: EmulatedCluster, identity: str, seconds: int = 2) -> LeaseElection:
    from kubernetes import client

    api = client.ApiClient(client.Configuration(host=emulated.url))
    return LeaseElection(api, "fleetplane", "fleetplane-controller", identity, seconds)


def holder(emulated: EmulatedCluster) -> str:
    stored = emulated.stored("coordination.k8s.io/v1/leases", "fleetplane",
                             "fleetplane-controller")
    assert stored is not None
    return str(stored["spec"]["holderIdentity"])


def test_one_holder_at_a_time_and_takeover_after_expiry(emulated: EmulatedCluster) -> None:
    first, second = election(emulated, "controller-a"), election(emulated, "controller-b")
    assert first.attempt() and first.leading
    assert not second.attempt() and not second.leading
    assert first.attempt()  # renewal
    assert holder(emulated) == "controller-a"
    time.sleep(2.2)  # controller-a stops renewing for the whole duration
    assert second.attempt()
    assert holder(emulated) == "controller-b"
    stored = emulated.stored("coordination.k8s.io/v1/leases", "fleetplane",
                             "fleetplane-controller")
    assert stored is not None and stored["spec"]["leaseTransitions"] == 1
    assert not first.attempt() and not first.leading  # the old holder learns it lost


def test_a_clean_stop_hands_over_at_once(emulated: EmulatedCluster) -> None:
    first, second = election(emulated, "controller-a", 60), election(emulated, "b", 60)
    assert first.attempt()
    first.release()
    assert second.attempt()
    assert holder(emulated) == "b"


def test_a_holder_that_loses_the_lease_stops_its_controllers(
        emulated: EmulatedCluster) -> None:
    first, second = election(emulated, "controller-a"), election(emulated, "controller-b")

    async def scenario() -> bool:
        stop = asyncio.Event()
        assert await first.acquire(stop)
        keeper = asyncio.create_task(first.keep(stop))
        await asyncio.sleep(0.1)
        # Someone else takes the Lease (as after a network partition outlasting it).
        await asyncio.to_thread(lambda: first.api.patch_namespaced_lease(
            "fleetplane-controller", "fleetplane", {"spec": {"holderIdentity": "other"}},
            _content_type="application/merge-patch+json"))
        await asyncio.wait_for(stop.wait(), timeout=5)
        await keeper
        return stop.is_set()

    assert asyncio.run(scenario())
    assert not first.leading
    assert not second.attempt()  # "other" holds a fresh Lease


def test_a_follower_waits_until_stopped(emulated: EmulatedCluster) -> None:
    leader, follower = election(emulated, "a", 60), election(emulated, "b", 60)
    assert leader.attempt()

    async def scenario() -> bool:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.5, stop.set)
        return await follower.acquire(stop)

    assert asyncio.run(scenario()) is False
