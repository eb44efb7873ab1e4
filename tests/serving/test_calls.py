"""Ids of requests and usage records (serving/calls.py's new_id)."""

from __future__ import annotations

import multiprocessing

from serving.calls import new_id


def made_in_a_child(connection: object) -> None:
    connection.send([new_id() for _ in range(3)])  # type: ignore[attr-defined]


def test_ids_are_unique_in_a_process_and_across_forked_workers() -> None:
    here = [new_id() for _ in range(1000)]
    receiving, sending = multiprocessing.get_context("fork").Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(target=made_in_a_child,
                                                        args=(sending,))
    child.start()
    there = receiving.recv()
    child.join(10)
    assert len(set(here + there + [new_id() for _ in range(3)])) == 1006
    assert all(len(made) == 32 and int(made, 16) >= 0 for made in here + there)
