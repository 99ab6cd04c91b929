"""A one-rank torch.distributed group in this process, outside Ray Train (which makes the group for
training itself)."""

from __future__ import annotations

import os
import socket


def single_process_group(backend: str) -> None:
    """This process as the one rank of its own torch.distributed group (a free loopback port), which
    DeepSpeed needs to build an engine: for `micro_batch: auto`'s probes and the benches' bare loops."""
    import torch.distributed as dist

    with socket.socket() as sock:  # a free port for this process's own one-rank group
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # What a launcher would set; DeepSpeed reads LOCAL_RANK itself.
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
