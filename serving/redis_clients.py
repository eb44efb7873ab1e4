"""The Redis clients of the data plane, made once rather than per use.

- `shared(url)`: the blocking client of this process (redis-py's is thread-safe, with its
  own connection pool), for the few writes and reads made outside the event loop: the
  route table published by the controller, the key-change bump on commit, the demand
  count the autoscaler reads.
- The event loop's own asyncio client is held by the gateway's per-loop resources
  (serving/gateway/resources.py): an asyncio client belongs to the loop it was made in.
"""

from __future__ import annotations

import threading
from typing import Any

# A Redis that stops answering (rather than refusing connections) fails a call within
# these bounds instead of holding a request or a reconcile pass: the data plane's
# commands are all quick ones.
CONNECT_TIMEOUT_SECONDS = 2.0
TIMEOUT_SECONDS = 5.0

_lock = threading.Lock()
_clients: dict[str, Any] = {}


def shared(url: str) -> Any:
    """This process's blocking client for `url`."""
    client = _clients.get(url)
    if client is None:
        import redis

        with _lock:
            client = _clients.get(url)
            if client is None:
                client = _clients[url] = redis.Redis.from_url(
                    url, socket_connect_timeout=CONNECT_TIMEOUT_SECONDS,
                    socket_timeout=TIMEOUT_SECONDS)
    return client


# Connections one event loop's client opens at most. A command beyond them waits for one
# to be free (at most TIMEOUT_SECONDS): redis-py's default pool instead fails a command
# at once past 100 in flight, so a burst of requests with rate limits got 503s.
EVENT_LOOP_CONNECTIONS = 64


def for_event_loop(url: str) -> Any:
    """A new asyncio client for `url`, to be kept by the event loop that made it.

    A command that finds its connection broken is sent once more on a new one: after a
    Redis restart every connection kept in the pool is dead, and each failed its first
    command (a rate-limited request answered 503) until it had been tried. A timeout is
    not tried again (a Redis that hangs still fails a call within TIMEOUT_SECONDS); a
    command whose connection broke after Redis ran it runs twice, which for the rate
    limits charges a request twice, never lets one through uncharged."""
    import redis.asyncio as redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as BrokenConnection

    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=EVENT_LOOP_CONNECTIONS, timeout=TIMEOUT_SECONDS,
        socket_connect_timeout=CONNECT_TIMEOUT_SECONDS, socket_timeout=TIMEOUT_SECONDS,
        retry=Retry(NoBackoff(), 1, (BrokenConnection,)))
    return redis.Redis.from_pool(pool)
