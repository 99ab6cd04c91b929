"""What the watchdog does to a hung worker group, from the coordinator actor: every worker's
Python stack (py-spy, in a task on the worker's node), the hang record and the stacks written into
the run directory, and the stuck workers' processes killed so that Ray Train sees a worker failure
and restarts the group from the newest checkpoint (a failure under resources.max_failures)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from raytrain_fast.console import say
from raytrain_fast.watchdog.hang import HangWatch, RankStack, Stuck, stuck_ranks, top_frame

logger = logging.getLogger("raytrain_fast.watchdog")

DUMP_TIMEOUT_S = 20.0
"""py-spy dump --nonblocking reads the memory without attaching: without it, py-spy fails on a SIGSTOPped process ("Failed to suspend process")."""


def dump_stack(pid: int) -> tuple[bool, str]:
    """(dumped, py-spy's dump of `pid` or why there is none). Runs on the process's node."""
    py_spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(py_spy):
        return False, "py-spy is not installed on this node (ray[default] installs it)"
    try:
        done = subprocess.run([py_spy, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True, timeout=DUMP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, f"py-spy dump --pid {pid} took more than {DUMP_TIMEOUT_S:.0f} s"
    if done.returncode != 0:
        return False, f"py-spy dump --pid {pid} failed: {(done.stderr or done.stdout).strip()[:500]}"
    return True, done.stdout


def kill_process(pid: int) -> bool:
    """SIGKILL `pid` (also ends a SIGSTOPped process). False if it was already gone."""
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def _on_node(function: Any, node_id: str) -> Any:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # num_cpus=0: the workers hold every CPU of their node; this must run beside them.
    return ray.remote(num_cpus=0, max_retries=0)(function).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    )


async def take_stacks(stuck: Stuck, *, now: float) -> list[RankStack]:
    """Every rank's stack, taken at once on each rank's node."""
    refs = [_on_node(dump_stack, beat.node_id).remote(beat.pid) for beat in stuck.ranks]
    stacks = []
    for beat, ref in zip(stuck.ranks, refs):
        try:
            dumped, text = await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout=DUMP_TIMEOUT_S + 10)
        except Exception as error:  # noqa: BLE001 - a node gone, a task that failed: say so in the record
            dumped, text = False, f"no stack: {error}"
        stacks.append(RankStack(rank=beat.rank, pid=beat.pid, text=text, dumped=dumped, beat_age_s=max(0.0, now - beat.seen)))
    return stacks


async def end_processes(stuck: Stuck, ranks: list[int]) -> None:
    for beat in stuck.ranks:
        if beat.rank in ranks:
            try:
                await asyncio.wait_for(asyncio.wrap_future(_on_node(kill_process, beat.node_id).remote(beat.pid).future()), timeout=30)
            except Exception as error:  # noqa: BLE001 - Ray's own health check (600 s) remains
                logger.warning("hang watchdog: could not kill rank %d (pid %d): %s", beat.rank, beat.pid, error)


def hang_record(stuck: Stuck, stacks: list[RankStack], *, beat_interval_s: float) -> dict[str, Any]:
    """The JSON the report reads: steps, ranks, how long, the top of each rank's stack."""
    culprits = stuck_ranks(stacks, beat_interval_s=beat_interval_s)
    now = time.time()
    return {
        "time": now, "step": stuck.step, "stuck_s": round(stuck.stuck_s, 1), "timeout_s": round(stuck.timeout_s, 1),
        "stuck_ranks": culprits, "waiting_ranks": [s.rank for s in stacks if s.waiting and s.rank not in culprits],
        "ranks": {
            str(s.rank): {
                "pid": s.pid, "in_collective": s.waiting, "top": top_frame(s.thread) if s.dumped else s.text.strip().splitlines()[0][:300],
                "heartbeat_age_s": round(s.beat_age_s, 1),
            }
            for s in stacks
        },
        "stacks_file": f"hangs/stacks-{int(now)}.txt",
    }


def hang_line(record: dict[str, Any]) -> str:
    """One line for the console and the log."""
    ranks = record["stuck_ranks"]
    tops = "; ".join(f"rank {r}: {record['ranks'][str(r)]['top']}" for r in ranks)
    waiting = record["waiting_ranks"]
    return (
        f"HANG at step {record['step']}: no rank completed a step for {record['stuck_s']:.0f} s (timeout "
        f"{record['timeout_s']:.0f} s). Stuck: rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        + (f" (rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} wait{'' if len(waiting) > 1 else 's'} in a collective). " if waiting else ". ")
        + f"Top of stack: {tops}. All stacks: {record['stacks_file']}. Ending the stuck processes: the group restarts from the newest checkpoint if resources.max_failures allows."
    )


def write_hang(filesystem: Any, run_path: str, record: dict[str, Any], stacks: list[RankStack]) -> None:
    """`<run>/hangs/hang-<time>.json` and the stacks beside it (local or S3 storage alike)."""
    filesystem.create_dir(f"{run_path}/hangs", recursive=True)
    text = "".join(f"=== rank {s.rank} (pid {s.pid}) ===\n{s.text}\n" for s in stacks)
    with filesystem.open_output_stream(f"{run_path}/{record['stacks_file']}") as out:
        out.write(text.encode())
    with filesystem.open_output_stream(f"{run_path}/hangs/hang-{int(record['time'])}.json") as out:
        out.write(json.dumps(record, indent=1).encode())


class Watchdog:
    """Lives in the run's coordinator actor (one per run, it outlives worker-group restarts): takes
    the heartbeats, checks every second, and acts once per hung worker group."""

    def __init__(self, *, timeout_s: float | str, min_timeout_s: float, beat_interval_s: float, filesystem: Any, run_path: str) -> None:
        self.watch = HangWatch(timeout_s=timeout_s, min_timeout_s=min_timeout_s, beat_interval_s=beat_interval_s)
        self.beat_interval_s = beat_interval_s
        self._filesystem, self._run_path = filesystem, run_path
        self.hangs: list[dict[str, Any]] = []
        self.announced = 0
        """Hangs rank 0 of a restarted group has announced (take_hangs)."""
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            stuck = self.watch.check(time.monotonic())
            if stuck is not None:
                try:
                    await self._act(stuck)
                except Exception:  # noqa: BLE001 - the watchdog must outlive one failed response
                    logger.exception("hang watchdog: acting on the hang at step %d failed", stuck.step)

    async def _act(self, stuck: Stuck) -> None:
        stacks = await take_stacks(stuck, now=time.monotonic())
        record = hang_record(stuck, stacks, beat_interval_s=self.beat_interval_s)
        try:
            write_hang(self._filesystem, self._run_path, record, stacks)
        except Exception as error:  # noqa: BLE001 - the restart matters more than the file
            logger.warning("hang watchdog: could not write the stacks into %s: %s", self._run_path, error)
        self.hangs.append(record)
        say(hang_line(record))  # the actor's stdout reaches the driver's console
        await end_processes(stuck, record["stuck_ranks"])
        self.watch.retire_all()

    async def stop(self) -> None:
        """Cancel the checks and wait for them to end (a response under way ends at its next await)."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
