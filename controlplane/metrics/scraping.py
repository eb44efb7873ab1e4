"""Scraping the replicas: every live replica's /metrics at once, through the gateway's
upstream client, with a timeout; each exposition reduced to the samples the collector
reads, and only the ones that changed since the last pass parsed: in batches in a worker
process as the scrapes come in (in the embedded setup the gateway shares this interpreter:
hundreds of parses here would hold up its relays), and the pass's last few here (a
reduced exposition takes tens of microseconds to parse, less than handing it over)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import multiprocessing
import signal
import sys
from typing import TYPE_CHECKING, Any

from serving.engine_metrics import Scrape, parse_reduced, reduce_exposition

if TYPE_CHECKING:
    from controlplane.metrics.store import MetricsStore
    from controlplane.metrics.targets import Target

logger = logging.getLogger(__name__)

PARSE_BATCH = 32  # expositions handed to the parser process at a time
# A pass's changed expositions left over after the batches, up to this many, are parsed in
# this process: a small fleet's collector never hands anything over (nor starts the worker).
INLINE_PARSES = 8
CONCURRENT_SCRAPES = 128


def parse_batch(texts: list[str]) -> list[Scrape | None]:
    """Parse reduced expositions (in the parser's worker process, or the pass's last few
    here); None for one that is not a reduced exposition."""
    out: list[Scrape | None] = []
    for text in texts:
        try:
            out.append(parse_reduced(text))
        except Exception:
            out.append(None)
    return out


def die_with_parent() -> None:
    """The parser process ends when the process that started it does, however that ends
    (even `kill -9`): Linux sends it SIGTERM then (PR_SET_PDEATHSIG)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Scraper:
    """Scrapes and parses one pass's targets; the store keeps each replica's last
    reduced exposition and its parse, so an unchanged one is not parsed again."""

    def __init__(self, store: MetricsStore, timeout: float) -> None:
        from serving.upstream import ConnectionPool

        self.store = store
        self.timeout = timeout
        self.client = ConnectionPool()
        self.concurrency = asyncio.Semaphore(CONCURRENT_SCRAPES)
        self.parsed_last_pass = 0
        self.batch: list[tuple[Target, str]] = []
        self.parsing: list[tuple[list[tuple[Target, str]], asyncio.Future[Any]]] = []
        self.pool: concurrent.futures.ProcessPoolExecutor | None = None

    async def fetch(self, url: str, path: str, key: str = "") -> str:
        """GET `url` + `path` as text, within the scrape timeout."""
        headers = (("Authorization", f"Bearer {key}"),) if key else ()
        async with self.concurrency, asyncio.timeout(self.timeout):
            return await self.client.get_text(url, path, headers)

    async def scrape_all(self, targets: list[Target]) -> list[Scrape | None]:
        """Every target's parsed exposition, in order; None for a failed scrape."""
        texts = await asyncio.gather(*(self.scrape(t) for t in targets))
        return await self.parse_all(targets, list(texts))

    async def scrape(self, target: Target) -> str | None:
        """The replica's exposition, reduced; None when the scrape fails. A changed one is
        queued for parsing at once, so parsing runs beside the scrapes still in flight."""
        try:
            text = reduce_exposition(await self.fetch(target.url, "/metrics", target.key))
        except Exception as exc:  # any failure is one missing sample, never a crash
            logger.debug("scrape of %s failed: %s", target.name, exc)
            return None
        series = self.store.replicas.get(target.name)
        if series is None or series.last_parsed is None or series.last_text != text:
            self.batch.append((target, text))
            if len(self.batch) >= PARSE_BATCH:
                self.submit_batch()
        return text

    def submit_batch(self) -> None:
        """Hand the expositions queued so far to the parser process."""
        batch, self.batch = self.batch, []
        if not batch:
            return
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.parser_pool(), parse_batch, [t for _, t in batch])
        self.parsing.append((batch, future))

    def parser_pool(self) -> concurrent.futures.Executor:
        """A worker process: parsing hundreds of expositions holds an interpreter for a
        while, and in the embedded setup the gateway shares this one."""
        if self.pool is None:
            self.pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                initializer=die_with_parent)
        return self.pool

    async def parse_all(self, targets: list[Target], texts: list[str | None]
                        ) -> list[Scrape | None]:
        """The pass's parsed expositions: the changed ones from the parser, the rest the
        same as at the replica's last scrape."""
        parsed: dict[str, Scrape | None] = {}
        changed = 0
        if len(self.batch) <= INLINE_PARSES:
            batch, self.batch = self.batch, []
            self.keep_parsed(batch, parse_batch([text for _, text in batch]), parsed)
            changed += len(batch)
        self.submit_batch()
        for batch, future in self.parsing:
            try:
                results = await future
            except Exception as exc:  # a broken worker: this pass's changes are missing
                logger.warning("parsing metrics failed: %s", exc)
                self.pool = None
                results = [None] * len(batch)
            self.keep_parsed(batch, results, parsed)
            changed += len(batch)
        self.parsing = []
        self.parsed_last_pass = changed
        out: list[Scrape | None] = []
        for target, text in zip(targets, texts, strict=True):
            if text is None:
                out.append(None)
            elif target.name in parsed:
                out.append(parsed[target.name])
            else:
                series = self.store.replicas.get(target.name)
                out.append(series.last_parsed if series is not None else None)
        return out

    def keep_parsed(self, batch: list[tuple[Target, str]], results: list[Scrape | None],
                    parsed: dict[str, Scrape | None]) -> None:
        """Note each target's parse in `parsed`, and keep it with its reduced text."""
        for (target, reduced), scrape in zip(batch, results, strict=True):
            parsed[target.name] = scrape
            if scrape is not None:
                kept = self.store.series(target)
                kept.last_text, kept.last_parsed = reduced, scrape

    def close(self) -> None:
        """Close the connections and stop the parser process."""
        self.client.close()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
