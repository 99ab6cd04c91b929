"""`raytrain-fast pretrain --drill NAME=SPEC`: each spec (the forms in docs/development.md#drills) parsed into
typed drills (drills/kinds.py), so a malformed one is refused before anything starts."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from raytrain_fast.drills import plants
from raytrain_fast.drills.kinds import (
    CpuBurn,
    FailOnce,
    Hang,
    HoldMemory,
    Nonfinite,
    RecordSequences,
    SlowData,
    SlowStep,
    SlowSink,
    SlowUpload,
)
from raytrain_fast.loop.hooks import LoopHooks, StepHooks


def _rate_specs(kind: type) -> Callable[[str], list[StepHooks]]:
    """"<seconds>[:<from_step>[:<rank>]]", comma-separated: one drill each."""
    def parse(text: str) -> list[StepHooks]:
        drills = []
        for item in filter(None, text.split(",")):
            seconds, *rest = item.split(":")
            rank = int(rest[1]) if len(rest) > 1 and rest[1] else None
            drills.append(kind(float(seconds), int(rest[0]) if rest and rest[0] else 0, rank))
        return drills
    return parse


def _fail_once(text: str) -> list[StepHooks]:
    step, marker, *rest = text.split(":")
    if not step.isdigit() or not marker:
        raise ValueError(text)
    return [FailOnce(int(step), marker, int(rest[0]) if rest else 0, rest[1:] == ["kill"])]


def _slow_upload(text: str) -> list[StepHooks]:
    drills = []
    for item in filter(None, text.split(",")):
        seconds, _, rank = item.partition(":")
        drills.append(SlowUpload(float(seconds), int(rank) if rank else None))
    return drills


PARSERS: dict[str, Callable[[str], list[StepHooks]]] = {
    "fail_once_at": _fail_once,
    "record_sequences": lambda text: [RecordSequences(text)],
    "slow_data": _rate_specs(SlowData),
    "slow_step": _rate_specs(SlowStep),
    "slow_sink": lambda text: [SlowSink(float(text))],
    "slow_upload": _slow_upload,
    "cpu_burn": lambda text: [CpuBurn(*plants.cpu_burn_range(text))],
    "hold_memory": lambda text: [HoldMemory(*plants.hold_memory_spec(text))],
    "hang": lambda text: [Hang(*plants.hang_spec(text))],
    "nonfinite": lambda text: [Nonfinite(*plants.nonfinite_spec(text))],  # (step, rank, what)
    "spike": lambda text: [Nonfinite(*plants.nonfinite_spec(text, kind="spike"))],
}


def parse_drills(items: Sequence[str]) -> LoopHooks:
    """`--drill NAME=SPEC` items. Raises ValueError naming the bad item and the names there are."""
    drills: list[StepHooks] = []
    for item in items:
        name, sep, spec = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in PARSERS:
            raise ValueError(f"--drill {item!r}: expected NAME=SPEC with NAME one of {', '.join(PARSERS)}")
        try:
            drills += PARSERS[name](spec)
        except (ValueError, TypeError, IndexError):
            raise ValueError(f"--drill {item!r}: malformed SPEC for {name} (forms: docs/development.md#drills)") from None
    return LoopHooks(*drills)
