"""Launching ``dist_worker.main`` on several gloo processes, with every wait bounded.

The ranks meet through a FileStore in a fresh temporary directory, so two runs cannot collide. Each
rank writes its result file before it tears down; a rank that crashes or hangs in teardown AFTER
writing it does not fail the test (it is reported as a warning), one that never wrote it fails the
test with its traceback. A hang fails the test instead of hanging CI.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import dist_worker
from dist_worker import COLLECTIVE_TIMEOUT, HANG_SECONDS, log_path, result_path

DEADLINE_SECONDS = HANG_SECONDS + 120  # hang guard only: a healthy run takes well under a minute
TEARDOWN_GRACE_SECONDS = 60  # once every rank has reported, how long teardown may take before a kill
POLL_SECONDS = 0.2


def read_log(out: Path, rank: int) -> str:
    try:
        return Path(log_path(str(out), rank)).read_text(errors="replace").strip()
    except OSError:
        return ""


def launch(
    world: int,
    out: Path,
    run: Callable[[int, int], dict[str, Any]] = dist_worker.scenarios,
    timeout: datetime.timedelta = COLLECTIVE_TIMEOUT,
) -> list[dict[str, Any]]:
    """Run ``dist_worker.main`` on ``world`` processes; every rank's result of ``run(rank, world)`` (a
    module-level function), or a failure that says why.

    ``timeout`` is every collective's: a rank blocked in one for longer raises. The wait for the ranks
    ends ``timeout`` + 60 s after one of them failed, and at the hang guard otherwise.
    """
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=dist_worker.main, args=(rank, world, str(out), run, timeout)) for rank in range(world)]
    for proc in procs:
        proc.start()

    def reported(rank: int) -> bool:
        return os.path.exists(result_path(str(out), rank))

    deadline = time.monotonic() + DEADLINE_SECONDS
    grace_end: float | None = None
    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < min(deadline, grace_end or deadline):
            now = time.monotonic()
            if grace_end is None and all(map(reported, range(world))):
                grace_end = now + TEARDOWN_GRACE_SECONDS  # every result is in: the rest is teardown
            elif grace_end is None and any(not p.is_alive() and p.exitcode != 0 for p in procs):
                # A rank failed: its peers may be blocked in a collective until its timeout, then
                # report that error; wait that long, not for the hang guard.
                grace_end = now + timeout.total_seconds() + 60
            procs[0].join(POLL_SECONDS)
    finally:
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for rank in hung:  # their Python stacks, into their logs, before the kill
            with contextlib.suppress(OSError):
                os.kill(procs[rank].pid, dist_worker.DUMP_SIGNAL)  # type: ignore[arg-type]
        if hung:
            time.sleep(2)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(30)

    problems: list[tuple[int, str]] = []  # (0: never reported, 1: raised, 2: raised because a peer died; text)
    results: list[dict[str, Any]] = []
    for rank, proc in enumerate(procs):
        if not reported(rank):
            state = (
                "still running when the wait ended: stacks dumped, killed"
                if rank in hung
                else f"exit code {proc.exitcode}"
            )
            problems.append((0, f"rank {rank} wrote no result ({state}); its log:\n{read_log(out, rank) or '(empty)'}"))
            continue
        item = torch.load(result_path(str(out), rank), weights_only=False)
        if "error" in item:
            problems.append((2 if "remote worker" in item["error"] else 1, f"rank {rank} raised:\n{item['error']}"))
            continue
        results.append(item)
        if rank in hung or proc.exitcode != 0:
            state = "hung" if rank in hung else f"exited with code {proc.exitcode}"
            warnings.warn(
                f"rank {rank} {state} in teardown, after writing its result: {read_log(out, rank)}", stacklevel=1
            )
    if problems:
        # The rank that failed first makes its peers fail with gloo's "... remote worker ..." errors:
        # its own story goes first. pytest.fail, not assert: pytest truncates long assertion messages.
        problems.sort(key=lambda problem: problem[0])
        pytest.fail("\n\n".join(text for _, text in problems), pytrace=False)
    return results
