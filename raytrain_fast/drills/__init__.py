"""Drills: plant a problem in a real run (slow data, a straggler, a slow sink or upload, host
contention, memory pressure, a hang, a non-finite loss, a spike, a failure) as typed `StepHooks`
objects the caller passes to the loop, e.g. `launch.trainer.run(config, hooks=LoopHooks(SlowData(0.1)))`,
or `raytrain-fast pretrain --drill slow_data=0.1`."""

from raytrain_fast.drills.kinds import (
    CpuBurn,
    FailOnce,
    Hang,
    HoldMemory,
    Nonfinite,
    RecordSequences,
    SlowData,
    SlowSink,
    SlowStep,
    SlowUpload,
    Spike,
)
from raytrain_fast.drills.specs import parse_drills
from raytrain_fast.loop.hooks import LoopHooks
