"""Where a batch's KV pages sit in the pool: the page tables the decode benchmarks read through.

- `shuffled`: every page anywhere (a pool after arbitrary churn; the worst case for the memory).
- `in_order`: each request's pages consecutive (a fresh pool handing out whole prompts).
- `served`: the order vLLM's block pool produces: blocks leave from the front of a free queue, a
  finished request's blocks go back to its end in reverse (vllm/v1/core/block_pool.py,
  single_type_kv_cache_manager.py), so after churn a prompt gets runs of consecutive ids, often
  descending, and decode steps append one block at a time, interleaved across requests.

Pure Python (no torch): the CPU tests check the tables, the GPU benchmarks time them.
"""

from __future__ import annotations

import collections
import random

PLACEMENTS = ("shuffled", "in_order", "served")


def page_tables(kind: str, batch: int, npages: int, page: int, seed: int = 0):
    """([batch][npages] page ids, pool size in pages) for `batch` requests of `npages` pages."""
    if kind not in PLACEMENTS:
        raise ValueError(f"placement {kind!r}: one of {PLACEMENTS}")
    if kind == "served":
        return _served(batch, npages, page, seed)
    nb = batch * npages + 16
    ids = list(range(nb))
    if kind == "shuffled":
        random.Random(seed).shuffle(ids)
    return [ids[i * npages:(i + 1) * npages] for i in range(batch)], nb


def _served(batch: int, npages: int, page: int, seed: int):
    """A pool twice the batch's pages (a server holds other work beside the batch measured). Churn
    first: `batch` concurrent requests of random prompt and output lengths until the pool has been
    handed out four times over (a request that finds no free block is preempted: its blocks are
    freed, as vLLM's recompute preemption does). Then the churn drains and the measured batch
    arrives: each prompt (context minus the tokens still to decode) allocated at admission, then
    the decode tokens in lock step, a block per `page` tokens."""
    rng = random.Random(seed)
    nb = 2 * batch * npages + 16
    free = collections.deque(range(nb))
    ctx = npages * page

    def take(n):
        return [free.popleft() for _ in range(n)] if len(free) >= n else None

    def release(blocks):
        free.extend(reversed(blocks))

    running = []  # [blocks, tokens, final tokens]
    handed = 0
    while handed < 4 * nb:
        while len(running) < batch:
            prompt = rng.randint(1, ctx)
            blocks = take(-(-prompt // page))
            if blocks is None:
                break
            handed += len(blocks)
            running.append([blocks, prompt, prompt + rng.randint(1, max(1, ctx // 4))])
        for r in list(running):
            r[1] += 1
            if r[1] > len(r[0]) * page:
                got = take(1)
                if got is None:  # preempted
                    release(r[0])
                    running.remove(r)
                    continue
                handed += 1
                r[0] += got
            if r[1] >= r[2]:
                release(r[0])
                running.remove(r)
    for r in running:
        release(r[0])

    decode = min(ctx - 1, max(1, ctx // 16))
    tables = []
    for _ in range(batch):
        prompt = ctx - decode
        tables.append(take(-(-prompt // page)))
    for t in range(ctx - decode + 1, ctx + 1):
        for blocks in tables:
            if t > len(blocks) * page:
                blocks += take(1)
    return tables, nb


def runs(table) -> dict:
    """Share of neighbouring pages of a request that are consecutive ids (ascending / descending)."""
    up = down = pairs = 0
    for row in table:
        for a, b in zip(row, row[1:]):
            pairs += 1
            up += b == a + 1
            down += b == a - 1
    return dict(ascending=up / max(1, pairs), descending=down / max(1, pairs))
