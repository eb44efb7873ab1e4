"""Load for watching the dashboards move: chat completions streamed through the gateway
with the official `openai` client, at a given concurrency, for a given time.

    python manage.py create_api_key --name load --scope inference   # prints KEY
    .venv/bin/python bench/load.py --key KEY [--model smollm2] [--concurrency 8]
        [--seconds 60] [--max-tokens 64] [--url http://127.0.0.1:8000]

Prints a line every 5 s and, last, the requests, tokens and errors seen.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import openai

PROMPTS = [
    "Name three colours of the rainbow.",
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Explain what a GPU does in one sentence.",
    "Give me a short tip for writing clear code.",
    "Describe a lighthouse in two sentences.",
]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--key", required=True, help="an API key with the inference scope")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--max-tokens", type=int, default=64)
    options = parser.parse_args()
    client = openai.AsyncOpenAI(base_url=options.url.rstrip("/") + "/v1", api_key=options.key,
                                max_retries=0, timeout=300)
    deadline = time.monotonic() + options.seconds
    counts = {"requests": 0, "tokens": 0, "errors": 0}

    async def worker(index: int) -> None:
        turn = index
        while time.monotonic() < deadline:
            turn += 1
            try:
                stream = await client.chat.completions.create(
                    model=options.model, max_tokens=options.max_tokens, stream=True,
                    stream_options={"include_usage": True},
                    messages=[{"role": "user", "content": PROMPTS[turn % len(PROMPTS)]}])
                async for chunk in stream:
                    if chunk.usage is not None:
                        counts["tokens"] += chunk.usage.completion_tokens
                counts["requests"] += 1
            except openai.APIError as exc:
                counts["errors"] += 1
                print(f"error: {exc}", flush=True)
                await asyncio.sleep(1)

    async def report() -> None:
        started = time.monotonic()
        while time.monotonic() < deadline:
            await asyncio.sleep(5)
            elapsed = time.monotonic() - started
            print(f"{elapsed:5.0f} s: {counts['requests']} requests, "
                  f"{counts['tokens'] / elapsed:.1f} tokens/s, {counts['errors']} errors",
                  flush=True)

    reporter = asyncio.create_task(report())
    await asyncio.gather(*(worker(i) for i in range(options.concurrency)))
    reporter.cancel()
    print(f"load: {counts['requests']} requests, {counts['tokens']} completion tokens, "
          f"{counts['errors']} errors in {options.seconds:.0f} s at concurrency "
          f"{options.concurrency}")


if __name__ == "__main__":
    asyncio.run(main())
