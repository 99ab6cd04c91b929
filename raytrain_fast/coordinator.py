"""One named Ray actor per run, and `Coordinator`, the one interface to it for the driver and the
workers alike (nothing else calls the actor). The launcher starts it before `fit()`
(`Coordinator.start`); workers find it by name (`Coordinator.connect`). docs/architecture.md ("The
per-run coordinator") describes its lifetime. It imports neither torch nor deepspeed.

It carries five of the run's concerns, each a few methods of the actor and of the interface:
- values measured once per run (FLOPs per token, the matmul peak): a claim protocol by which exactly
  one rank measures each value (a claim not renewed for `lease_s` expires), carried through
  checkpoints by `export_state` / `import_state`;
- the driver's stop notice to rank 0 (`request_stop`, `watch_for_stop`);
- the hang watchdog (`start_watchdog`, `beat`, `take_hangs`; its logic is watchdog/, the actor holds
  it, passes the beats on and ends it with the run: `end`);
- the previous worker group's size (`swap_group_size`), so a resized group is noticed;
- the divergence verdict the workers leave for the driver (`report_divergence`, `divergence`).
They share one actor because each needs exactly its lifetime, and nothing else has it: one per run,
owned by the driver, outliving every worker-group restart, reachable by name from each new group.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from raytrain_fast.errors import RaytrainFastError

logger = logging.getLogger("raytrain_fast.coordinator")

STATE_VERSION = 1
FLOPS_MISMATCH = 0.10
"""Relative disagreement between counted FLOPs and the model's formula that is worth a warning."""


class CoordinatorError(RaytrainFastError):
    """A value every rank needs was not measured in time, or the run's coordinator is unreachable."""


def coordinator_name(run_name: str) -> str:
    """The actor's name, derived from the run name (named actors live in the job's namespace)."""
    return f"raytrain_fast-coordinator-{run_name}"


class _CoordinatorActor:
    """Holds the run's measured values. Async: waiting ranks do not block posts."""

    def __init__(self, run_name: str) -> None:
        self.run_name = run_name
        self._values: dict[str, Any] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._claims: dict[str, tuple[str, float]] = {}  # key -> (claim token, last renewal)
        self._events: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self._measured: dict[str, int] = {}
        self._next_token = 0
        self._stop_reason: str | None = None
        self._watchdog: Any = None
        self._group_size: int | None = None
        self._divergence: str | None = None

    async def claim(self, key: str, may_measure: bool, lease_s: float) -> tuple[str, Any]:
        """("have", value) | ("measure", token): measure, renew with the token, post | ("wait", None)."""
        if key in self._values:
            return "have", self._values[key]
        if not may_measure:
            return "wait", None
        held = self._claims.get(key)
        if held is not None and time.monotonic() - held[1] < lease_s:
            return "wait", None
        self._next_token += 1
        token = str(self._next_token)
        self._claims[key] = (token, time.monotonic())
        return "measure", token

    async def renew(self, key: str, token: str) -> bool:
        """The claimant is still measuring. False if its claim expired and was taken over."""
        held = self._claims.get(key)
        if held is None or held[0] != token:
            return False
        self._claims[key] = (token, time.monotonic())
        return True

    async def post(self, key: str, value: Any, meta: dict[str, Any]) -> Any:
        """Store a measured value (the first post wins). Returns the stored value."""
        self._measured[key] = self._measured.get(key, 0) + 1
        if key not in self._values:
            self._values[key] = value
            self._meta[key] = meta
        self._claims.pop(key, None)
        self._events[key].set()
        return self._values[key]

    async def release(self, key: str, token: str) -> None:
        """The claimant failed to measure: let another rank claim at once."""
        held = self._claims.get(key)
        if held is not None and held[0] == token:
            del self._claims[key]

    async def wait(self, key: str, timeout_s: float) -> tuple[bool, Any]:
        if key not in self._values:
            try:
                await asyncio.wait_for(self._events[key].wait(), timeout=timeout_s)
            except asyncio.TimeoutError:
                return False, None
        return True, self._values[key]

    async def export_state(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "run_name": self.run_name, "values": dict(self._values), "meta": dict(self._meta)}

    async def import_state(self, state: dict[str, Any]) -> list[str]:
        """Adopt values from a checkpoint (never overwriting values this run already has)."""
        if state.get("version") != STATE_VERSION:
            return []
        adopted = []
        for key, value in state.get("values", {}).items():
            if key not in self._values:
                self._values[key] = value
                self._meta[key] = {**state.get("meta", {}).get(key, {}), "imported": True}
                self._events[key].set()
                adopted.append(key)
        return adopted

    async def measurements(self) -> dict[str, int]:
        return dict(self._measured)

    async def request_stop(self, reason: str) -> None:
        if self._stop_reason is None:
            self._stop_reason = reason
        self._events["__stop__"].set()

    async def wait_for_stop(self, timeout_s: float) -> str | None:
        """The stop reason as soon as there is one, or None after timeout_s."""
        try:
            await asyncio.wait_for(self._events["__stop__"].wait(), timeout=timeout_s)
        except asyncio.TimeoutError:
            pass
        return self._stop_reason

    # --- the hang watchdog (watchdog/stacks.py): heartbeats in; stacks, a record and a restart out ---

    async def start_watchdog(self, **settings: Any) -> None:
        """The driver, before fit(): watch the heartbeats from now on (`settings`: the Watchdog's)."""
        from raytrain_fast.watchdog.stacks import Watchdog

        if self._watchdog is None:
            self._watchdog = Watchdog(**settings)

    async def beat(self, **beat: Any) -> None:
        """A rank's heartbeat (watchdog/hang.py's `beat`, less the time, which is the actor's)."""
        if self._watchdog is not None:
            self._watchdog.watch.beat(**beat, now=time.monotonic())

    async def beat_end(self, *, rank: int, pid: int) -> None:
        if self._watchdog is not None:
            self._watchdog.watch.end(rank=rank, pid=pid)

    async def swap_group_size(self, world_size: int) -> int | None:
        previous, self._group_size = self._group_size, world_size
        return previous

    async def take_hangs(self) -> list[dict[str, Any]]:
        """The hangs not yet taken: rank 0 of the restarted group announces each once."""
        if self._watchdog is None:
            return []
        taken, self._watchdog.announced = self._watchdog.hangs[self._watchdog.announced:], len(self._watchdog.hangs)
        return list(taken)

    async def report_divergence(self, message: str) -> None:
        """Rank 0: the run stopped on divergence (the first report stays)."""
        self._divergence = self._divergence or message

    async def divergence(self) -> str | None:
        return self._divergence

    async def end(self) -> None:
        """The run is over: the watchdog's task is cancelled and waited for before the driver kills
        the actor (a task still pending when the actor's event loop goes prints asyncio's "Task was
        destroyed but it is pending!")."""
        if self._watchdog is not None:
            await self._watchdog.stop()


@dataclass(frozen=True, kw_only=True)
class FlopsPerToken:
    counted: float
    """Counted with FlopCounterMode over one forward + backward micro-batch (rank 0, once per run)."""
    formula: float | None
    """The model's own formula (6N + attention), when it has one."""

    @property
    def for_mfu(self) -> float:
        """The formula when there is one (the usual MFU convention, comparable across codebases), else the count."""
        return self.formula if self.formula is not None else self.counted


def model_fingerprint(*parts: Any) -> str:
    """A short stable hash of what determines FLOPs per token (model config, sequence length):
    a value measured for another shape is never reused."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


class Coordinator:
    """The one interface to the run's coordinator actor, for the driver (`start` ... `end`) and the workers (`connect`)."""

    def __init__(self, actor: Any, *, run_name: str, timeout_s: float = 600.0, lease_s: float = 20.0) -> None:
        self.actor = actor
        self.run_name = run_name
        self.timeout_s = timeout_s
        self.lease_s = lease_s
        """A claim not renewed for this long expires (its rank died); renewals come every lease_s / 4."""
        self._stop_reason: str | None = None
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None

    @classmethod
    def start(cls, run_name: str) -> Coordinator:
        """Launcher, before `fit()`: the run's coordinator actor (created, or the existing one).

        Not detached: it lives as long as the driver, across worker-group restarts. Pinned to the
        driver's node: a worker node can go away (preemption, an elastic shrink), and the actor with
        it. The pin is hard (soft=False, as Ray Data pins its own coordinator): a soft pin spilled it
        onto a worker node in about one creation of four when the driver's node has no CPUs (a head
        started with --num-cpus=0), and a run then died with its first lost node. The driver's node
        going away ends the run anyway."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        # num_cpus=0: it only answers small calls, and must never hold back a training worker.
        actor = ray.remote(num_cpus=0, max_restarts=0)(_CoordinatorActor).options(
            name=coordinator_name(run_name), get_if_exists=True, scheduling_strategy=here,
        ).remote(run_name)
        return cls(actor, run_name=run_name)

    def end(self) -> None:
        """The driver, when the run is over: the watchdog ended cleanly, then the actor (the next run
        of this name starts a fresh one: its values come from checkpoints). Quiet when Ray is gone."""
        import ray

        with contextlib.suppress(Exception):
            ray.get(self.actor.end.remote(), timeout=10)
        with contextlib.suppress(Exception):
            ray.kill(self.actor)

    @classmethod
    def connect(cls, run_name: str, *, timeout_s: float = 600.0, create_if_missing: bool = True) -> Coordinator:
        """Find the run's actor by name. If the launcher did not create one (a bare TorchTrainer),
        create it here, with a warning: owned by this worker, it dies with it (no reuse after a restart)."""
        import ray

        name = coordinator_name(run_name)
        try:
            actor = ray.get_actor(name)
        except ValueError:
            if not create_if_missing:
                raise CoordinatorError(
                    f"no coordinator actor '{name}' in this Ray job; the launcher creates it with "
                    "Coordinator.start(run_name) before fit()"
                ) from None
            logger.warning(
                "coordinator actor '%s' not found (launcher did not start it): creating it from this worker; "
                "measured values will not survive a worker-group restart", name,
            )
            actor = cls.start(run_name).actor
        return cls(actor, run_name=run_name, timeout_s=timeout_s)

    def get_or_measure(self, key: str, *, measure: Callable[[], Any], may_measure: bool, who: str, meta: Mapping[str, Any] | None = None) -> Any:
        """The value under `key`: measured by exactly one rank per run, read by all the others.

        `who` names the rank(s) expected to measure, for the timeout error.
        """
        import ray

        deadline = time.monotonic() + self.timeout_s
        while True:
            verdict, value = ray.get(self.actor.claim.remote(key, may_measure, self.lease_s))
            if verdict == "have":
                return value
            if verdict == "measure":
                return self._measure_and_post(key, token=value, measure=measure, meta=meta)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CoordinatorError(
                    f"waited {self.timeout_s:.0f} s for '{key}' from {who} through the coordinator of run "
                    f"'{self.run_name}', and it was never posted: did that rank fail or hang while measuring? "
                    "(its own error, if any, is in its log; metrics.coordinator_timeout_s sets this limit)"
                )
            found, value = ray.get(self.actor.wait.remote(key, min(remaining, self.lease_s, 30.0)))
            if found:
                return value

    def _measure_and_post(self, key: str, *, token: str, measure: Callable[[], Any], meta: Mapping[str, Any] | None) -> Any:
        import ray

        done = threading.Event()

        def renew() -> None:
            while not done.wait(self.lease_s / 4):
                try:
                    ray.get(self.actor.renew.remote(key, token))
                except Exception:  # the actor is gone: the measurement's post will say so
                    return

        renewer = threading.Thread(target=renew, name=f"raytrain-fast-claim-{key}", daemon=True)
        renewer.start()
        started = time.perf_counter()
        try:
            value = measure()
        except BaseException:
            ray.get(self.actor.release.remote(key, token))
            raise
        finally:
            done.set()
        info = {**(meta or {}), "measure_s": round(time.perf_counter() - started, 3), "time": time.time()}
        return ray.get(self.actor.post.remote(key, value, info))

    def flops_per_token(
        self, *, rank: int, count: Callable[[], float], formula: float | None, fingerprint: str
    ) -> FlopsPerToken:
        """Rank 0 counts FLOPs per token once per run (`count`, e.g. a closure over
        `count_training_flops_per_token(model, tokens)`) and posts it; the other ranks wait for it.

        If the count and the model's formula disagree by more than 10%, rank 0 logs a warning
        naming both.
        """

        def measure() -> dict[str, float | None]:
            counted = float(count())
            if formula and abs(counted - formula) / formula > FLOPS_MISMATCH:
                logger.warning(
                    "FLOPs per token: counted %.4g (FlopCounterMode, one forward + backward) but the model's formula "
                    "gives %.4g (%+.0f%%); MFU uses the formula. A large gap means the formula misses part of the "
                    "model or the counter misses an op.", counted, formula, 100 * (counted - formula) / formula,
                )
            return {"counted": counted, "formula": formula}

        value = self.get_or_measure(
            f"flops_per_token/{fingerprint}", measure=measure, may_measure=rank == 0, who="rank 0",
            meta={"rank": rank},
        )
        return FlopsPerToken(counted=float(value["counted"]), formula=value["formula"])

    def achievable_peak(self, *, device_key: str, dtype: str, seconds: float, measure: Callable[[], float]) -> float:
        """Measured matmul FLOP/s of this device type in `dtype` (`measure()`, e.g.
        metrics.peak.measure_matmul_peak), once per run and device type (the first rank of that type
        measures; any others wait)."""
        key, who = f"peak/{device_key}/{dtype}", "the first rank on this device type"
        return float(self.get_or_measure(key, measure=measure, may_measure=True, who=who, meta={"seconds": seconds}))

    def watch_for_stop(self, *, poll_s: float = 1.0) -> None:
        """Start a daemon thread that waits on the actor for the driver's stop request, so that
        `stop_requested()` answers on the next log step without a call on the training thread."""
        import ray

        def watch() -> None:
            while not self._closed.is_set():
                try:
                    reason = ray.get(self.actor.wait_for_stop.remote(poll_s))
                except ray.exceptions.RayError as error:  # the driver (and its actor) is gone: Ray stops us anyway
                    if not self._closed.is_set():
                        logger.warning("coordinator unreachable, no longer watching for stop requests: %s", error)
                    return
                if reason is not None:
                    self._stop_reason = reason
                    return

        self._watcher = threading.Thread(target=watch, name="raytrain-fast-stop-watch", daemon=True)
        self._watcher.start()

    def stop_requested(self) -> str | None:
        """The driver's stop reason once `watch_for_stop` has seen it, else None. Never waits."""
        return self._stop_reason

    def close(self) -> None:
        """End the stop watcher (within poll_s) and wait for it: a thread still inside ray.get
        while the process exits can crash the interpreter's shutdown."""
        self._closed.set()
        if self._watcher is not None:
            self._watcher.join(timeout=10)

    def _call(self, method: str, *args: Any, wait_s: float | None = None, **kwargs: Any) -> Any:
        """The actor's `method`, called and waited for (at most `wait_s`)."""
        import ray

        return ray.get(getattr(self.actor, method).remote(*args, **kwargs), timeout=wait_s)

    # --- measured once ------------------------------------------------------------------------

    def export_state(self) -> dict[str, Any]:
        """JSON-able values to store in a checkpoint."""
        return self._call("export_state")

    def import_state(self, state: Mapping[str, Any] | None) -> list[str]:
        """Adopt values saved in a checkpoint (call on resume, before asking for any value)."""
        return self._call("import_state", dict(state)) if state else []

    def measurements(self) -> dict[str, int]:
        """How many times each value was measured and posted during the actor's life."""
        return self._call("measurements")

    # --- the stop notice (the driver's side; the workers': watch_for_stop above) -----------------

    def request_stop(self, reason: str) -> None:
        """The driver got a stop notice (SIGTERM, Ctrl-C): the workers save and stop. Not waited for (a signal's
        thread sends it)."""
        self.actor.request_stop.remote(reason)

    # --- the hang watchdog ----------------------------------------------------------------------

    def start_watchdog(self, **settings: Any) -> None:
        """The driver, before fit(): the hang watchdog watches the heartbeats from now on
        (`settings`: watchdog/stacks.py's `Watchdog`)."""
        self._call("start_watchdog", **settings)

    def beat(self, *, timeout_s: float, **beat: Any) -> None:
        """A rank's heartbeat (watchdog/heartbeat.py)."""
        self._call("beat", wait_s=timeout_s, **beat)

    def beat_end(self, *, rank: int, pid: int) -> None:
        """The rank left the loop: a finished run is no hang."""
        self._call("beat_end", rank=rank, pid=pid, wait_s=10)

    def take_hangs(self) -> list[dict[str, Any]]:
        """The watchdog's hang records not yet announced (see watchdog/stacks.py)."""
        return self._call("take_hangs")

    # --- the worker group's size, the divergence verdict ----------------------------------------

    def swap_group_size(self, world_size: int) -> int | None:
        """Rank 0 of each worker group: the previous group's size in this job (None for the first); this one's is kept."""
        return self._call("swap_group_size", world_size)

    def report_divergence(self, message: str) -> None:
        """Rank 0: the run stops on divergence; the driver raises `message`."""
        self._call("report_divergence", message)

    def divergence(self) -> str | None:
        """The driver, after fit(): the divergence the workers stopped on, or None."""
        return self._call("divergence")
