"""The log step's one collective, which every rank takes part in at the same step.

It carries the window's on-device sums (an all-reduce), a few host floats per rank (an all-gather:
time to reach the log step, data wait, GC, CPU share and wait) and each rank's bit flags, and ends in
ONE host read. So what one rank knows ("my checkpoint timer is due", "a stop notice reached me",
"Ray is draining my node") becomes what every rank knows, at the same step, with no extra
collective or sync: the loop decides its saves and stops from `StepAgreement.flags`."""

from __future__ import annotations

from typing import Any

import torch


class StepAgreement:
    """Every rank's view of a log step, agreed by one collective. One per worker; with one rank the
    "collective" is a read of the local sums."""

    def __init__(self, *, world_size: int, device: torch.device, host_floats: int, process_group: Any = None) -> None:
        import torch.distributed as dist

        self.world_size, self.group = world_size, process_group
        self.distributed = world_size > 1 and dist.is_available() and dist.is_initialized()
        self._width = host_floats + 1  # the flags ride as the last float (exact in fp32 below 2**24)
        if self.distributed:
            cuda = device.type == "cuda"
            self._host = torch.zeros(self._width, dtype=torch.float32, pin_memory=cuda)
            self._device_row = torch.zeros(self._width, dtype=torch.float32, device=device)
            self._gathered = [torch.zeros(self._width, dtype=torch.float32, device=device) for _ in range(world_size)]
        self.flags = 0
        """The bitwise OR of the flags every rank passed to the last `drain`."""

    def drain(self, sums: torch.Tensor, host: list[float], flags: int = 0) -> tuple[list[float], list[list[float]]]:
        """(the sums over every rank, each rank's host floats). Both collectives are queued on the
        device without waiting; then ONE host sync reads everything (it waits for all queued work)."""
        if not self.distributed:
            self.flags = flags
            return sums.tolist(), [list(host)]  # HOST SYNC: the one per log window
        import torch.distributed as dist

        self._host.copy_(torch.tensor([*host, float(flags)], dtype=torch.float32))
        self._device_row.copy_(self._host, non_blocking=True)
        dist.all_reduce(sums, group=self.group)
        dist.all_gather(self._gathered, self._device_row, group=self.group)
        values = torch.cat([sums, *self._gathered]).tolist()  # HOST SYNC: the one per log window
        n = sums.numel()
        rows = [values[n + i * self._width: n + (i + 1) * self._width] for i in range(self.world_size)]
        self.flags = 0
        for row in rows:
            self.flags |= int(round(row[-1]))
        return values[:n], [row[:-1] for row in rows]

    def all_finite(self, sums: torch.Tensor) -> bool:
        """Whether `sums` is finite on every rank: one all-reduce (with several ranks) and ONE host read."""
        bad = (~torch.isfinite(sums)).any().float()
        if self.distributed:
            import torch.distributed as dist

            dist.all_reduce(bad, group=self.group)
        return not bool(bad.item())  # HOST SYNC
