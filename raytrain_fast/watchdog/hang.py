"""The hang watchdog's decisions, without Ray: which ranks beat, when the run counts as hung, and
which ranks a set of py-spy stacks shows outside the collective the others wait in.

The coordinator actor (coordinator.py) feeds `HangWatch` the heartbeats and asks `check()` every
second; stacks.py takes the stacks and ends the stuck processes. See docs/health-hangs.md.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from raytrain_fast._ray_compat import TRAIN_COLLECTIVE_FILES
from raytrain_fast.config.watchdog import AUTO_MAX_S, AUTO_STEPS

WATCHED_PHASE = "train"
"""The phase a heartbeat reports while the loop steps; any other (a save) is not watched."""

# A frame from one of these files means the thread is inside a collective (or Ray Train's own
# barrier), waiting for the other ranks.
_COLLECTIVE_FILES = ("torch/distributed/", "deepspeed/comm/", *TRAIN_COLLECTIVE_FILES)
# The training thread is the one running the step loop (Ray Train runs it beside the actor's own threads).
_LOOP_FRAMES = ("run_steps", "train_loop_per_worker")
# Pass-through decorators: their frame only calls the next one in, so it says nothing of where a rank is
# (DeepSpeed wraps most of its engine in an NVTX range; torch's no_grad/enable_grad in _contextlib).
_WRAPPER_FILES = ("deepspeed/utils/nvtx.py", "torch/utils/_contextlib.py", "/functools.py", "/contextlib.py")


@dataclass(kw_only=True)
class RankBeat:
    """The newest heartbeat of one rank."""

    rank: int
    pid: int
    node_id: str
    step: int
    phase: str
    start_step: int
    """The step its loop started (or resumed) at: until it completes the next one (compile, restore), it is not watched."""
    seen: float
    """When (monotonic) the last heartbeat came."""
    advanced: float
    """When (monotonic) its step or phase last changed."""


@dataclass(kw_only=True)
class Stuck:
    """No rank completed a step for `stuck_s` > `timeout_s`."""

    step: int
    """The highest step any rank completed."""
    stuck_s: float
    timeout_s: float
    ranks: list[RankBeat]


class HangWatch:
    """Heartbeats in, a `Stuck` out when no rank has advanced for the timeout (once per worker group)."""

    def __init__(self, *, timeout_s: float | str, min_timeout_s: float, beat_interval_s: float = 1.0) -> None:
        self.setting = timeout_s
        self.min_timeout_s = min_timeout_s
        self.silent_after_s = 3 * beat_interval_s
        """A rank whose heartbeats stopped this long ago is frozen, whatever phase it last reported."""
        self.world_size = 0
        self.ranks: dict[int, RankBeat] = {}
        self._retired: set[int] = set()  # pids of a previous worker group: their late beats are ignored
        self._step_s: deque[float] = deque(maxlen=64)
        self._fired = False

    def beat(self, *, rank: int, world_size: int, pid: int, node_id: str, step: int, start_step: int, phase: str, now: float) -> None:
        if pid in self._retired:
            return
        old = self.ranks.get(rank)
        if old is None or old.pid != pid:  # a new worker (a restart): it is watched again from its second step
            if old is not None:
                self._retired.add(old.pid)
            if world_size != self.world_size:
                self.ranks = {r: b for r, b in self.ranks.items() if r < world_size}
            self.world_size = world_size
            self._fired = False
            self.ranks[rank] = RankBeat(rank=rank, pid=pid, node_id=node_id, step=step, phase=phase, start_step=start_step, seen=now, advanced=now)
            return
        if step != old.step or phase != old.phase:
            if rank == min(self.ranks) and phase == old.phase == WATCHED_PHASE and step > old.step > old.start_step:
                self._step_s.append((now - old.advanced) / (step - old.step))
            old.step, old.phase, old.advanced = step, phase, now
        old.seen = now

    def end(self, *, rank: int, pid: int) -> None:
        """A rank left the loop (the run finished or stopped): nothing of it is watched any more."""
        beat = self.ranks.get(rank)
        if beat is not None and beat.pid == pid:
            del self.ranks[rank]
            self._retired.add(pid)

    def timeout_s(self) -> float:
        if self.setting != "auto":
            return float(self.setting)
        step_s = statistics.median(self._step_s) if self._step_s else None  # per step, as the heartbeats saw it
        return min(AUTO_MAX_S, max(self.min_timeout_s, AUTO_STEPS * step_s if step_s else self.min_timeout_s))

    def armed(self, now: float) -> bool:
        """Every rank of the group has beaten, the group has completed its first step since it
        started (any rank past it: a step's gradient all-reduce needs every rank, so one rank's
        count says it for all, even for a rank that froze before its next beat), and no rank that
        still beats is in an unwatched phase (a save). A silent rank's last phase does not count:
        a process frozen during a save is a hang too."""
        beats = list(self.ranks.values())
        return (
            not self._fired and self.world_size > 0 and len(beats) == self.world_size
            and any(b.step > b.start_step for b in beats)
            and all(b.phase == WATCHED_PHASE or now - b.seen > self.silent_after_s for b in beats)
        )

    def check(self, now: float) -> Stuck | None:
        """A `Stuck` the first time no rank has advanced for the timeout; None otherwise."""
        if not self.armed(now):
            return None
        last = max(b.advanced for b in self.ranks.values())
        timeout = self.timeout_s()
        if now - last <= timeout:
            return None
        self._fired = True
        ranks = sorted(self.ranks.values(), key=lambda b: b.rank)
        return Stuck(step=max(b.step for b in ranks), stuck_s=now - last, timeout_s=timeout, ranks=ranks)

    def retire_all(self) -> None:
        """The group is being restarted: beats from its processes no longer count."""
        self._retired.update(b.pid for b in self.ranks.values())
        self.ranks = {}


# --- stacks ---------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Thread:
    frames: list[str] = field(default_factory=list)
    """Innermost first, as py-spy prints them: `function (file:line)`."""


def parse_py_spy(text: str) -> list[Thread]:
    """The threads of a `py-spy dump` output."""
    threads: list[Thread] = []
    for line in text.splitlines():
        if line.startswith("Thread "):
            threads.append(Thread())
        elif threads and line.startswith(" ") and line.strip():
            threads[-1].frames.append(line.strip())
    return threads


def training_thread(threads: list[Thread]) -> Thread | None:
    """The thread running the step loop, if the dump has one."""
    return next((t for t in threads if any(name in frame for frame in t.frames for name in _LOOP_FRAMES)), None)


def top_frame(thread: Thread | None) -> str:
    """The innermost frame that is not a pass-through wrapper (the line a reader looks at first):
    a rank frozen while DeepSpeed's NVTX decorator calls into C shows the DeepSpeed function it wraps."""
    if thread is None or not thread.frames:
        return "no stack"
    return next((frame for frame in thread.frames if not any(w in frame for w in _WRAPPER_FILES)), thread.frames[0])


@dataclass(kw_only=True)
class RankStack:
    rank: int
    pid: int
    text: str
    """py-spy's whole dump, or why there is none."""
    dumped: bool
    beat_age_s: float
    """Seconds since its last heartbeat: a frozen process (SIGSTOP) stops beating, a busy one does not."""

    @property
    def thread(self) -> Thread | None:
        return training_thread(parse_py_spy(self.text)) if self.dumped else None

    @property
    def waiting(self) -> bool:
        """In a collective: waiting for the others, not the cause."""
        thread = self.thread
        return thread is not None and any(path in frame for frame in thread.frames for path in _COLLECTIVE_FILES)


def stuck_ranks(stacks: list[RankStack], *, beat_interval_s: float) -> list[int]:
    """The ranks that are not in the collective where the others wait. When the stacks do not tell
    (every rank in a collective, or none), the ranks whose heartbeats stopped; else all of them."""
    outside = [s.rank for s in stacks if not s.waiting]
    if outside and len(outside) < len(stacks):
        return outside
    silent = [s.rank for s in stacks if s.beat_age_s > 3 * beat_interval_s]
    if silent and len(silent) < len(stacks):
        return silent
    return [s.rank for s in stacks]
