"""Regional compilation: `torch.compile` on each transformer block, before DeepSpeed wraps the model.

Compiling the blocks (not the whole model) is torchtitan's approach: every block has the same code
and shapes, so one compiled graph serves all layers and compile time does not grow with depth;
DeepSpeed's hooks stay outside the compiled regions. `nn.Module.compile` compiles in place, so the
parameter names, and with them the checkpoint format, are those of the eager model: a checkpoint
written with compile on loads with it off and the other way round.
"""

from __future__ import annotations

import torch

CPU_COMPILE_NOTE = "off on CPUs (compiled blocks measured 0.96x eager on 2 cores, after a 20 s compile)"


def resolve_compile(setting: str, device: torch.device) -> tuple[bool, str]:
    """engine.compile (auto | on | off) for this device: (compile?, why)."""
    if setting in ("on", "off"):
        return setting == "on", f"engine.compile={setting}"
    if device.type == "cuda":
        return True, "engine.compile=auto: on for CUDA GPUs"
    return False, f"engine.compile=auto: {CPU_COMPILE_NOTE}"


def _compiler_works(device: torch.device) -> str | None:
    """None when torch.compile's default backend builds and runs a kernel on `device`, else why not
    (no C++ compiler on a CPU host, no Triton on a GPU host, ...). A few seconds, once."""
    try:
        probe = torch.compile(lambda x: torch.sin(x) * 2 + 1)
        probe(torch.ones(8, device=device))
        return None
    except Exception as error:  # noqa: BLE001 - any failure means: run eager
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200] if str(error).strip() else ''}"


def compile_blocks(model: torch.nn.Module, *, setting: str, device: torch.device) -> tuple[bool, str | None]:
    """Compile each of `model.blocks` in place when engine.compile asks for it on this device.

    Returns (compiled, a line to print: None when auto left it off, the usual CPU case). Compilation itself happens on the first
    forward. A compiler that does not work falls back to eager; an op that the compiler cannot take
    later runs that part eagerly (engine/deepspeed_compat.py) instead of crashing the run.
    """
    wanted, why = resolve_compile(setting, device)
    if not wanted:
        return False, None
    problem = _compiler_works(device)
    if problem is not None:
        return False, f"Compile: off, torch.compile does not work here ({problem}); training runs eager ({why})"
    from raytrain_fast.engine.deepspeed_compat import run_eagerly_where_compile_fails

    run_eagerly_where_compile_fails()
    for block in model.blocks:
        block.compile()
    return True, f"Compile: on, {len(model.blocks)} blocks compiled on their first step ({why})"
