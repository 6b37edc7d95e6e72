"""Shared by the batching tests: the same jobs run one at a time, then all at once."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable


def sequential_and_concurrent(run: Callable[..., object], scheduler, jobs: list[dict]):
    """run(**job) for each job one at a time, then all at once on len(jobs) threads while the
    verifier's scheduler records its iterations. Returns (sequential, concurrent, trace): the two
    lists of results in job order and the sessions of each iteration."""
    sequential = [run(**j) for j in jobs]
    scheduler.trace = []
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            concurrent = list(pool.map(lambda j: run(**j), jobs))
    finally:
        trace, scheduler.trace = scheduler.trace, None
    return sequential, concurrent, trace
