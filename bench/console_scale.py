"""Console at fleet scale: the pages, REST lists and fleet socket with N deployments, this
checkout against another (`--baseline`, e.g. an export of an older commit), side by side.

Each product is `manage.py serve` of its checkout on a fresh data folder (SQLite), with
`--models` models and N external deployments (one external backend each, pointing at a
closed port on 127.0.0.1: every probe is refused at once) written straight into its
database through its own `manage.py shell` (the REST API would take minutes per product;
the pages and lists read the same rows). Once every deployment has its replica, the
script GETs each page and list with its defaults (and a filtered page, and the deployment
list's own refresh with and without a matching ETag), ROUNDS times per product, the
products interleaved round by round, and prints the median time and the bytes; then it
listens to each product's fleet socket (`/ws/dashboard/`) for LISTEN_SECONDS and prints
the first message's size and the largest after it.

    .venv/bin/python bench/console_scale.py [--deployments 1000]
        [--baseline /path/to/older/checkout]

The last line: the largest page, list and socket message of this checkout (and of the
baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.dashboard_fanout import session_cookie  # noqa: E402
from bench.planes import ControlPlane  # noqa: E402

PAGES = ("/deployments/", "/models/", "/keys/", "/dashboard/", "/deployments/fleet-00999/",
         "/deployments/?search=fleet-009&state=running", "/deployments/?page=20")
APIS = ("/api/v1/deployments/", "/api/v1/models/", "/api/v1/backends/",
        "/api/v1/replicas/", "/api/v1/events/", "/api/v1/keys/",
        "/api/v1/deployments/?search=fleet-009&state=running")
ROUNDS = 5
LISTEN_SECONDS = 9.0
PASSWORD = "console-bench-password"

FILL = """
from controlplane.models import Backend, Deployment
from models_registry.models import Model
models = Model.objects.bulk_create([Model(
    name=f"fleet-model-{m:04d}", display_name=f"Fleet model {m}", source="huggingface",
    source_uri=f"bench/fleet-{m}", status="ready", architecture="LlamaForCausalLM",
    parameter_count=134515008, context_length=8192, dtype="bfloat16", num_layers=30,
    num_attention_heads=9, num_kv_heads=3, head_size=64) for m in range(MODELS)])
backends = Backend.objects.bulk_create([Backend(
    name=f"fleet-{i:05d}-endpoint", kind="external", config={"url": URL})
    for i in range(COUNT)])
Deployment.objects.bulk_create([Deployment(
    name=f"fleet-{i:05d}", model=models[i % len(models)], backend=backends[i])
    for i in range(COUNT)])
"""


class Product(ControlPlane):
    """One checkout's `serve`, filled with the fleet."""

    def __init__(self, root: Path, label: str) -> None:
        self.root = root
        self.label = label
        super().__init__()

    def fill(self, deployments: int, models: int, closed: str) -> None:
        self.manage("shell", "-c", f"COUNT, MODELS, URL = {deployments}, {models}, "
                    f"{closed!r}\n" + FILL)
        self.create_superuser("console", PASSWORD)
        self.cookie = session_cookie(self.url, "console", PASSWORD)
        self.bearer = {"Authorization": f"Bearer {self.admin}"}

    def replicas(self) -> int:
        answer = httpx.get(f"{self.url}/api/v1/replicas/?limit=1", headers=self.bearer,
                           timeout=60)
        return int(answer.json()["count"])


def timed(client: httpx.Client, path: str, headers: dict[str, str]) -> tuple[float, int,
                                                                             int]:
    started = time.perf_counter()
    answer = client.get(path, headers=headers)
    return time.perf_counter() - started, len(answer.content), answer.status_code


def measure(products: list[Product]) -> dict[tuple[str, str], tuple[float, int, int]]:
    """Median seconds, bytes and status of each path per product, rounds interleaved."""
    seen: dict[tuple[str, str], list[tuple[float, int, int]]] = {}
    clients = {p.label: httpx.Client(base_url=p.url, timeout=120) for p in products}
    for _ in range(ROUNDS):
        for product in products:
            client = clients[product.label]
            for path in (*PAGES, *APIS):
                headers = ({"Cookie": product.cookie} if not path.startswith("/api/")
                           else product.bearer)
                seen.setdefault((product.label, path), []).append(
                    timed(client, path, headers))
            # The deployment list's own refresh (static/js/refresh.js), then again with
            # the ETag it got: what a tab left open costs every 5 s.
            refresh = {"Cookie": product.cookie, "X-Fragment": "deployment-list"}
            first = client.get("/deployments/", headers=refresh)
            seen.setdefault((product.label, "refresh of /deployments/"), []).append(
                (first.elapsed.total_seconds(), len(first.content), first.status_code))
            again = {**refresh, "If-None-Match": first.headers.get("ETag", "")}
            seen.setdefault((product.label, "refresh of /deployments/, unchanged"),
                            []).append(timed(client, "/deployments/", again))
    for client in clients.values():
        client.close()
    return {key: (statistics.median(s for s, _, _ in rows), rows[-1][1], rows[-1][2])
            for key, rows in seen.items()}


def socket_sizes(product: Product) -> list[int]:
    from websockets.asyncio.client import connect

    async def listen() -> list[int]:
        sizes: list[int] = []
        async with connect(product.url.replace("http://", "ws://") + "/ws/dashboard/",
                           additional_headers={"Cookie": product.cookie,
                                               "Origin": product.url},
                           max_size=None) as socket:
            deadline = time.monotonic() + LISTEN_SECONDS
            while (left := deadline - time.monotonic()) > 0:
                try:
                    message = await asyncio.wait_for(socket.recv(), timeout=left)
                except TimeoutError:
                    break
                sizes.append(len(message.encode() if isinstance(message, str) else message))
        return sizes

    return asyncio.run(listen())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deployments", type=int, default=1000)
    parser.add_argument("--models", type=int, default=100)
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout to measure beside this one")
    options = parser.parse_args()
    from tests.processes import free_port

    closed = f"http://127.0.0.1:{free_port()}"
    roots = [(ROOT, "this checkout")]
    if options.baseline:
        roots.insert(0, (options.baseline.resolve(), "baseline"))
    products: list[Product] = []
    try:
        for root, label in roots:
            product = Product(root, label)
            products.append(product)
            product.fill(options.deployments, options.models, closed)
        deadline = time.monotonic() + 600
        while any(p.replicas() < options.deployments for p in products):
            if time.monotonic() > deadline:
                raise SystemExit("the replicas were not all made within 600 s")
            time.sleep(2)
        figures = measure(products)
        sockets = {p.label: socket_sizes(p) for p in products}
    finally:
        for product in products:
            product.stop()
    largest: dict[str, dict[str, int]] = {}
    for (label, path), (seconds, size, status) in figures.items():
        print(f"{label:>14}  {path:<55} HTTP {status}  {seconds * 1000:6.0f} ms  "
              f"{size:>9,} bytes")
        kind = "list" if path.startswith("/api/") else "page"
        largest.setdefault(label, {}).setdefault(kind, 0)
        largest[label][kind] = max(largest[label][kind], size)
    for label, sizes in sockets.items():
        later = max(sizes[1:], default=0)
        print(f"{label:>14}  fleet socket: {len(sizes)} messages in {LISTEN_SECONDS:.0f} s; "
              f"first {sizes[0] if sizes else 0:,} bytes, largest after it {later:,} bytes")
        largest[label]["socket"] = max(sizes, default=0)
    print(f"console at {options.deployments:,} deployments, largest page / list / socket "
          "message: " + "; ".join(
              f"{label} {v['page']:,} / {v['list']:,} / {v['socket']:,} bytes"
              for label, v in largest.items()))


if __name__ == "__main__":
    main()
