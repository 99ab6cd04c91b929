"""DeepSpeed's checkpoint files written off the training thread (checkpoint.write=background, see
docs/checkpoints.md). `SnapshotWriter.save` takes a snapshot of each state dict DeepSpeed hands its
checkpoint engine and returns; a writer thread serializes the snapshots; `wait` returns once every
file is on disk (the upload calls it before it copies, so storage only ever gets complete files).

The snapshot goes into the writer's own host buffers (`HostBuffers`), reserved before the first step
from the engine's state (`reserve`) and reused by every save: pinning about 17 GB for llama-1b's
first save held up the training thread's kernel launches for 12 s on an H100, and copies to pageable
memory stalled every save alike (docs/benchmarks.md). On a GPU the copies run on a side stream and
`save` returns at once; the optimizer's next step waits for them (`guard`: a step pre-hook that calls
`fence`), since nothing else changes the saved tensors, so they overlap the next step's forward and
backward and no GPU memory is spent on the snapshot. Without a guarded optimizer, `save` waits for
the copies itself. On a CPU the copies are done when `save` returns.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from raytrain_fast.errors import CheckpointError


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _same(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors one: the same memory seen the same way. A state dict lists tied weights
    (an embedding tied to the LM head) as two tensor objects over one storage."""
    return t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


def _map(value: Any, fn, memo: dict[tuple[Any, ...], Any] | None = None) -> Any:
    """`value` with every tensor replaced by fn(tensor), once per storage view (tied weights, listed
    twice, stay one tensor); containers copied, other leaves shared."""
    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        if _same(value) not in memo:
            memo[_same(value)] = fn(value)
        return memo[_same(value)]
    if isinstance(value, dict):
        out = copy.copy(value)  # keeps the type (OrderedDict, defaultdict) and its attributes
        for k, v in value.items():
            out[k] = _map(v, fn, memo)
        return out
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_map(v, fn, memo) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, fn, memo) for v in value)
    return value


def _nbytes(tensors: list[torch.Tensor]) -> int:
    """What copies of these tensors take (a view's copy holds only the view)."""
    unique = {_same(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


def _key(t: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    return t.dtype, tuple(t.shape)


class HostBuffers:
    """Host tensors that snapshots are copied into, lent to one snapshot at a time and given back once
    its file is written: pinned when the state is on a GPU (a device-to-host copy into pinned memory
    runs on the copy engine while training goes on), plain memory on a CPU. A save that finds no free
    buffer of a tensor's dtype and shape allocates one (a miss), which joins the pool when given back."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, tuple[int, ...]], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.allocated_bytes = 0
        """Bytes of every buffer ever allocated: reserved, and allocated by saves that missed."""
        self.missed_bytes = 0
        """Bytes that saves had to allocate, the way to see that `reserve` did not cover a save."""

    def reserve(self, tensors: list[torch.Tensor]) -> int:
        """Free buffers for every tensor of `tensors` that the pool cannot already serve, allocated
        now (pinned if any tensor is on a GPU); returns the bytes allocated."""
        pinned = any(t.is_cuda for t in tensors)
        wanted = collections.Counter(_key(t) for t in {_same(t): t for t in tensors}.values())
        added = 0
        for (dtype, shape), count in wanted.items():
            with self._lock:
                have = len(self._free.get((dtype, shape), []))
            for _ in range(count - have):
                buffer = self._allocate(dtype, shape, pinned=pinned)
                added += buffer.numel() * buffer.element_size()
                self.give_back([buffer])
        return added

    def take(self, like: torch.Tensor, *, pinned: bool) -> torch.Tensor:
        """A free buffer of `like`'s dtype and shape, or a new one (a miss)."""
        with self._lock:
            free = self._free.get(_key(like))
            if free:
                return free.pop()
        buffer = self._allocate(like.dtype, tuple(like.shape), pinned=pinned)
        self.missed_bytes += buffer.numel() * buffer.element_size()
        return buffer

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            for buffer in {id(b): b for b in buffers}.values():  # a tensor a state lists twice is one buffer
                self._free.setdefault(_key(buffer), []).append(buffer)

    def _allocate(self, dtype: torch.dtype, shape: tuple[int, ...], *, pinned: bool) -> torch.Tensor:
        # zero_ faults every page in now: plain memory is only mapped by torch.empty, and a save
        # that touches it first would pay for the page faults (pinned memory is resident already).
        buffer = torch.empty(shape, dtype=dtype, pin_memory=pinned)
        if not pinned:
            buffer.zero_()
        self.allocated_bytes += buffer.numel() * buffer.element_size()
        return buffer


def training_optimizer(engine: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer whose step updates a DeepSpeed engine's weights and optimizer state: the
    one its ZeRO or bf16 wrapper holds, or the engine's own; None if neither is one."""
    wrapper = getattr(engine, "optimizer", None)
    for candidate in (getattr(wrapper, "optimizer", None), wrapper):
        if isinstance(candidate, torch.optim.Optimizer):
            return candidate
    return None


@contextlib.contextmanager
def optimizer_state_as_after_a_step(engine: Any) -> Iterator[None]:
    """The engine's AdamW state as it is after the first optimizer step, for a save made before it
    (`SnapshotWriter.reserve` at start-up): torch's AdamW makes exp_avg, exp_avg_sq and step on its
    first step, and DeepSpeed's ZeRO optimizer does not step at construction. Zeros of those shapes
    stand in, and are taken out again afterwards, so the first real step makes its own, as it would
    have (parameters that already have state, e.g. after a resume, are left alone)."""
    base = training_optimizer(engine)
    made = []
    if isinstance(base, torch.optim.AdamW):
        for group in base.param_groups:
            for p in group["params"]:
                if not base.state.get(p):
                    base.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                     "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                    made.append(p)
    try:
        yield
    finally:
        for p in made:
            base.state.pop(p, None)


class SnapshotWriter:
    """One per training process: `save(state_dict, path)` snapshots and queues; `wait()` blocks until
    every queued file is written and raises what the writer thread hit."""

    def __init__(self) -> None:
        self.buffers = HostBuffers()
        self._reserving: list[torch.Tensor] | None = None
        self._jobs: queue.Queue[tuple[Any, str, Any] | None] = queue.Queue()
        self._pending = 0
        self._done = threading.Condition()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._streams: dict[Any, Any] = {}  # one side stream per CUDA device
        self._unfenced: list[tuple[torch.device, Any]] = []  # copies the training stream has not waited for yet
        self._guarded: Any = None  # the optimizer whose steps call `fence`
        self._hook: Any = None  # its step pre-hook's handle
        self.last_snapshot: str | None = None
        """How the last snapshot was taken: pinned_host_async (on a side stream, fenced at the next
        optimizer step), pinned_host (copied before save returned) or host (tests read it)."""

    # ------------------------------------------------------------------ training thread
    def reserve(self, save_all: Callable[[], None]) -> tuple[int, float]:
        """Allocate the host buffers that the saves `save_all` makes (every file of one checkpoint,
        through `save`) will take, without writing anything; returns (bytes allocated, seconds).
        Called before the first step, so that no save allocates while training runs."""
        started = time.perf_counter()
        self._reserving = tensors = []
        try:
            save_all()
        finally:
            self._reserving = None
        return self.buffers.reserve(tensors), time.perf_counter() - started

    def guard(self, optimizer: torch.optim.Optimizer | None) -> bool:
        """Have every step of `optimizer` (the one that updates the saved weights and state) first
        make the training stream wait for the snapshot copies in flight, so that `save` need not
        wait for them. Returns whether saves are asynchronous from now on."""
        if optimizer is self._guarded:
            return optimizer is not None
        self._unguard()
        if not isinstance(optimizer, torch.optim.Optimizer):
            return False
        self._hook = optimizer.register_step_pre_hook(lambda *_: self.fence())
        self._guarded = optimizer
        return True

    def _unguard(self) -> None:
        if self._hook is not None:
            self._hook.remove()
        self._hook, self._guarded = None, None

    def fence(self) -> None:
        """Make each device's current stream wait for every snapshot copy queued so far: call it before
        anything changes the saved tensors (a guarded optimizer's step does). No host wait."""
        while self._unfenced:
            device, copied = self._unfenced.pop()
            torch.cuda.current_stream(device).wait_event(copied)

    def save(self, state_dict: Any, path: str) -> None:
        tensors = _tensors(state_dict)
        if self._reserving is not None:  # a save made by `reserve`: its tensors' sizes are what it wants
            self._reserving += tensors
            return
        copied = None
        if any(t.is_cuda for t in tensors):
            snapshot, copied = self._to_pinned_host(state_dict)
            if self._guarded is None:
                copied.synchronize()  # a deliberate host wait: nothing else keeps training off the tensors
                copied = None
            where = "pinned_host" if copied is None else "pinned_host_async"
        else:  # on the CPU: copied into host buffers before `save` returns
            snapshot, where = _map(state_dict, lambda t: self.buffers.take(t, pinned=False).copy_(t.detach())), "host"
        self.last_snapshot = where
        with self._done:
            self._pending += 1
        self._start()
        self._jobs.put((snapshot, path, copied))

    def _to_pinned_host(self, state_dict: Any) -> tuple[Any, Any]:
        """Copies into pinned host buffers queued on a side stream after what training queued so far;
        returns the snapshot and the event that marks them done."""
        device = next(t.device for t in _tensors(state_dict) if t.is_cuda)
        if device not in self._streams:  # the device's side stream: the copies overlap training's kernels
            self._streams[device] = torch.cuda.Stream(device=device)
        stream = self._streams[device]
        stream.wait_stream(torch.cuda.current_stream(device))

        def copy(t: torch.Tensor) -> torch.Tensor:
            host = self.buffers.take(t, pinned=True)
            with torch.cuda.stream(stream):
                host.copy_(t.detach(), non_blocking=True)
            if t.is_cuda:
                # A tensor the state dict made for the occasion (a view's copy) is freed once save
                # returns: its memory must not be handed out again before the copy has read it.
                t.record_stream(stream)
            return host

        snapshot = _map(state_dict, copy)
        copied = torch.cuda.Event()
        copied.record(stream)
        # Without a guarded optimizer nobody fences: `save` waits on the event itself, so keep none.
        if self._guarded is not None:
            self._unfenced.append((device, copied))
        return snapshot, copied

    def wait(self) -> None:
        """Block until every file queued so far is written; raise the first error the writer hit."""
        with self._done:
            self._done.wait_for(lambda: self._pending == 0)
            error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"writing the checkpoint's files failed: {error}") from error

    def close(self) -> None:
        """Write what is queued, then stop the writer thread and unhook the guarded optimizer."""
        self._unguard()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------------ writer thread
    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._write_loop, name="raytrain-fast-ckpt-writer", daemon=True)
            self._thread.start()

    def _write_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            snapshot, path, copied = job
            del job
            try:
                if copied is not None:
                    copied.synchronize()  # this thread's wait, not training's
                torch.save(snapshot, path)
            except BaseException as error:  # noqa: BLE001 - handed to the thread that waits
                with self._done:
                    self._error = self._error or error
            finally:
                self.buffers.give_back(_tensors(snapshot))  # written (or failed): the next save may copy into them
                snapshot = None
                with self._done:
                    self._pending -= 1
                    self._done.notify_all()
