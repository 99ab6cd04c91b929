"""One variant of `raytrain-fast bench model` in its own process: builds the model and engine (or the
bare optimizer), then answers the parent's commands over a pipe: info, warm-up, timed steps, memory,
close; and the bench's handle on it (`VariantProcess`), which ends it with the bench, SIGTERM included.
Memory statistics: bench/model.py's docstring."""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import time
import traceback
from typing import Any

from raytrain_fast.errors import RaytrainFastError

COMPILED_VARIANTS = {"engine_compiled", "engine_compiled_ac"}


def release_cached_memory(device: Any) -> None:
    """Hand the memory the allocator keeps free for reuse back to the system, so the memory in use
    read next is what the process holds live: glibc's malloc keeps freed heap pages (a step's
    activations, mostly) in the RSS, CUDA's caching allocator keeps freed blocks reserved."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        import ctypes
        import ctypes.util

        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc: the RSS keeps what malloc kept
        pass


class _Variant:
    """One variant's model, optimizer or engine and tokens, in this process."""

    def __init__(self, job: dict[str, Any]) -> None:
        import torch

        from raytrain_fast.config import Config
        from raytrain_fast.engine.program import prepare_process
        from raytrain_fast.metrics.memory import memory_in_use_gb, reset_peak_memory

        started = time.perf_counter()
        self.name = job["name"]
        self.device = device = prepare_process(threads=job["threads"], seed=job["seed"])  # as a training worker
        config = Config.from_dict(job["config"])
        self.precision, self.seq_len = config.engine.precision, config.data.seq_len
        batch = config.batch()
        self.micro_batch, self.grad_accum = batch.micro_batch, batch.grad_accum
        generator = torch.Generator().manual_seed(job["seed"])  # the same tokens in every variant
        tokens = torch.randint(0, config.model.vocab_size, (self.micro_batch, self.seq_len + 1), generator=generator)
        self.tokens = tokens.to(device)
        self._build(config)
        release_cached_memory(device)
        self.setup_s = time.perf_counter() - started
        self.built_gb = memory_in_use_gb(device)
        reset_peak_memory(device)

    def _build(self, config: Any) -> None:
        """The training worker's program (engine/program.py) with the variant's compile and
        activation checkpointing; the `bare` variant's engine is plain PyTorch (engine/step.py)."""
        from raytrain_fast.engine.program import build_program

        with_deepspeed = self.name != "bare"  # every other variant trains through DeepSpeed's engine
        if with_deepspeed:
            from raytrain_fast.engine.process_group import single_process_group

            single_process_group("nccl" if self.device.type == "cuda" else "gloo")
        program = build_program(config, device=self.device, engine="deepspeed" if with_deepspeed else "torch")
        self.model, self.engine = program.model, program.engine
        self.compiled, self.compile_note = program.compiled, program.compile_line
        self.batches = itertools.repeat((self.tokens, None))  # the same tokens every micro-batch

    def step(self) -> Any:
        """One training step (engine/step.py) over grad_accum micro-batches; returns the last loss
        tensor (never read here)."""
        from raytrain_fast.engine.step import train_step

        return train_step(self.engine, self.batches, grad_accum=self.grad_accum)

    def _sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # end of a window only; CPU ops are done when they return

    def info(self) -> dict[str, Any]:
        import torch

        return {
            "setup_s": self.setup_s, "built_gb": self.built_gb, "compiled": self.compiled,
            "compile_note": self.compile_note, "precision": self.precision, "seq_len": self.seq_len,
            "micro_batch": self.micro_batch, "grad_accum": self.grad_accum, "threads": torch.get_num_threads(),
            "activation_checkpointing": self.model.config.activation_checkpointing,
        }

    def warmup(self, count: int) -> dict[str, Any]:
        """`count` untimed steps, each on the host clock (the first: compilation included), then the
        peak starts over: the timed steps' peak is training's steady one."""
        from raytrain_fast.metrics.memory import memory_in_use_gb, peak_memory_gb, reset_peak_memory

        step_s = []
        for _ in range(count):
            start = time.perf_counter()
            self.step()
            self._sync()
            step_s.append(time.perf_counter() - start)
        warmup_peak_gb = peak_memory_gb(self.device)
        release_cached_memory(self.device)
        result = {"step_s": step_s, "warmup_peak_gb": warmup_peak_gb, "setup_gb": memory_in_use_gb(self.device)}
        reset_peak_memory(self.device)
        return result

    def run(self, count: int) -> dict[str, Any]:
        """`count` timed steps: the clock around all of them, one device sync at the end."""
        loss = None
        cpu_start, start = time.process_time(), time.perf_counter()
        for _ in range(count):
            loss = self.step()
        self._sync()
        elapsed, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        return {"steps": count, "elapsed_s": elapsed, "cpu_s": cpu_s, "loss": float(loss.detach().float())}

    def memory(self) -> dict[str, Any]:
        from raytrain_fast.metrics.memory import peak_memory_gb

        return {"peak_gb": peak_memory_gb(self.device)}

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _end_with_parent() -> None:
    """Linux: this process is killed when the bench's process ends, however it ends (SIGKILL too), so
    a variant never runs on alone in the middle of a long setup or round."""
    import ctypes
    import multiprocessing
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it ended before the line above
        os._exit(1)


def worker_main(conn: Any, job: dict[str, Any]) -> None:
    """A variant's process: set up, then answer (command, argument) messages until `exit`."""
    _end_with_parent()
    os.dup2(2, 1)  # DeepSpeed and torch print to stdout; the bench's stdout carries only its JSON
    os.environ.update(job["env"])
    variant = None
    try:
        variant = _Variant(job)
        conn.send(("ok", variant.info()))
        while True:
            command, argument = conn.recv()
            if command == "exit":
                break
            conn.send(("ok", getattr(variant, command)(argument) if argument is not None else getattr(variant, command)()))
    except EOFError:  # the parent is gone
        pass
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        if variant is not None:
            with contextlib.suppress(Exception):
                variant.close()
        conn.close()


class VariantProcess:
    """The parent's handle on one variant's process."""

    def __init__(self, context: Any, job: dict[str, Any]) -> None:
        self.name = job["name"]
        self.conn, child = context.Pipe()
        self.process = context.Process(target=worker_main, args=(child, job), name=f"bench-model-{self.name}", daemon=True)
        self.process.start()
        child.close()

    def ask(self, command: str, argument: Any = None) -> dict[str, Any]:
        self.conn.send((command, argument))
        return self.answer()

    def answer(self, timeout_s: float | None = None) -> dict[str, Any]:
        if timeout_s is not None and not self.conn.poll(timeout_s):
            raise RaytrainFastError(f"bench model: variant '{self.name}' did not finish its setup in {timeout_s:.0f} s")
        try:
            status, value = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise RaytrainFastError(
                f"bench model: the process of variant '{self.name}' died (exit code {self.process.exitcode}; "
                "killed for memory? try a smaller --micro-batch or --seq-len, or fewer --variants)"
            ) from None
        if status != "ok":
            raise RaytrainFastError(f"bench model: variant '{self.name}' failed:\n{value}")
        return value

    def stop(self, *, now: bool = False) -> None:
        """Ask the process to exit (`now`: end it at once, the bench itself was stopped)."""
        if not now:
            with contextlib.suppress(Exception):
                self.conn.send(("exit", None))
            self.process.join(30)
        for end in (self.process.terminate, self.process.kill):
            if self.process.is_alive():
                end()
                self.process.join(5)
        self.conn.close()


@contextlib.contextmanager
def stopped_by_sigterm():
    """SIGTERM (`kill`, a job's stop) becomes SystemExit(143) in the main thread (the CLI's), so the
    variant processes are ended on the way out instead of outliving the bench; yields a list that
    holds the signal's number once it came."""
    import signal

    came: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        came.append(signum)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield came
    finally:
        signal.signal(signal.SIGTERM, previous)
