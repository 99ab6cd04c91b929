"""DeepSpeed's checkpoint files written off the training thread (checkpoint.write=background, see
docs/checkpoints.md). `SnapshotWriter.save` takes a snapshot of each state dict DeepSpeed hands its
checkpoint engine and returns; a writer thread serializes the snapshots; `wait` returns once every
file is on disk (the upload calls it before it copies, so storage only ever gets complete files).

The snapshot, per tensor: on a GPU with room for it, a copy in device memory, which the writer
thread copies into pinned host memory on its own CUDA stream while training goes on, then frees; on
a GPU without that room, a copy into pinned host memory, finished before `save` returns; on a CPU, a
copy in memory. The pinned memory comes from torch's caching host allocator and is reused by every
later save (copies to pageable memory stalled every save alike: docs/benchmarks.md).
"""

from __future__ import annotations

import copy
import queue
import threading
from typing import Any

import torch

from raytrain_fast.errors import CheckpointError

DEVICE_HEADROOM = 1.25
"""A device snapshot needs this many times its size free on the GPU (free + the allocator's cached
free blocks), so training's next step still finds its memory."""


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _map(value: Any, fn, memo: dict[int, Any] | None = None) -> Any:
    """`value` with every tensor replaced by fn(tensor), once per tensor (a tensor listed twice, as
    tied embeddings are, stays one tensor); containers copied, other leaves shared."""
    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            memo[id(value)] = fn(value)
        return memo[id(value)]
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
    unique = {id(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


def _device_room(device: torch.device) -> int:
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class SnapshotWriter:
    """One per training process: `save(state_dict, path)` snapshots and queues; `wait()` blocks until
    every queued file is written and raises what the writer thread hit."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[Any, str, Any] | None] = queue.Queue()
        self._pending = 0
        self._done = threading.Condition()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._streams: dict[Any, Any] = {}  # one side stream per CUDA device
        self.last_snapshot: str | None = None
        """Where the last snapshot was taken: device, pinned_host or host (tests read it)."""

    # ------------------------------------------------------------------ training thread
    def save(self, state_dict: Any, path: str) -> None:
        tensors = _tensors(state_dict)
        cuda = [t for t in tensors if t.is_cuda]
        if not cuda:
            snapshot, where, ready = _map(state_dict, lambda t: t.detach().clone()), "host", None
        elif _device_room(cuda[0].device) >= DEVICE_HEADROOM * _nbytes(cuda):
            snapshot, where = _map(state_dict, lambda t: t.detach().clone()), "device"
            ready = (cuda[0].device, torch.cuda.Event())
            ready[1].record(torch.cuda.current_stream(cuda[0].device))  # the clones are queued there: the writer waits for them
        else:
            snapshot, where, ready = self._to_pinned_host(state_dict), "pinned_host", None
        self.last_snapshot = where
        with self._done:
            self._pending += 1
        self._start()
        self._jobs.put((snapshot, path, ready))

    def _to_pinned_host(self, state_dict: Any) -> Any:
        """Copies into pinned host memory on a side stream, finished before returning (one host wait)."""
        device = next(t.device for t in _tensors(state_dict) if t.is_cuda)
        stream = self._side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))

        def copy(t: torch.Tensor) -> torch.Tensor:
            if not t.is_cuda:
                return t.detach().clone()
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                host.copy_(t.detach(), non_blocking=True)
            t.record_stream(stream)
            return host

        snapshot = _map(state_dict, copy)
        stream.synchronize()  # a deliberate host wait: training may change the tensors once save returns
        return snapshot

    def wait(self) -> None:
        """Block until every file queued so far is written; raise the first error the writer hit."""
        with self._done:
            self._done.wait_for(lambda: self._pending == 0)
            error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"writing the checkpoint's files failed: {error}") from error

    def close(self) -> None:
        """Write what is queued, then stop the writer thread."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------------ writer thread
    def _side_stream(self, device: torch.device) -> Any:
        """A CUDA stream of `device` for the copies to the host (they overlap training's kernels)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._write_loop, name="raytrain-fast-ckpt-writer", daemon=True)
            self._thread.start()

    def _write_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            snapshot, path, ready = job
            del job  # the snapshot's only references are this thread's: the device copies go once copied
            try:
                if ready is not None:
                    snapshot = self._device_to_host(snapshot, ready)
                torch.save(snapshot, path)
            except BaseException as error:  # noqa: BLE001 - handed to the thread that waits
                with self._done:
                    self._error = self._error or error
            finally:
                snapshot = None
                with self._done:
                    self._pending -= 1
                    self._done.notify_all()

    def _device_to_host(self, snapshot: Any, ready: tuple[torch.device, Any]) -> Any:
        """The device snapshot copied into pinned host memory on a side stream of its device (this
        thread's current device may be another), so training's stream never waits for it; the
        device copies are freed once it is done."""
        device, event = ready
        stream = self._side_stream(device)
        stream.wait_event(event)

        def to_host(t: torch.Tensor) -> torch.Tensor:
            if not t.is_cuda:
                return t
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)  # torch's pinned cache: reused by the next save
            host.copy_(t, non_blocking=True)
            return host

        with torch.cuda.device(device), torch.cuda.stream(stream):
            host = _map(snapshot, to_host)
        stream.synchronize()
        return host
