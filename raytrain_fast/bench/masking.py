"""What document masking costs: forward + backward of one model with `data.document_masking` off
and on, interleaved, per dtype (docs/data.md#document-masking).

    python -m raytrain_fast.bench.masking --d-model 384 --layers 6 --heads 6 --seq-len 256 --micro-batch 8

One model per dtype; the variants share its weights (masking is switched on the same module), run
in alternating order round after round, and are summarised alike: the median step time (wall clock
and this process's CPU time) over every timed step of every round. Rows are packed like prepare-data's: documents of random lengths (a
geometric distribution of mean `--mean-doc`), each ended by the end-of-document id.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from raytrain_fast.config.data import EOD_TOKEN
from raytrain_fast.console import say
from raytrain_fast.model import ModelConfig, build_model
from raytrain_fast.model.documents import DocumentMasking

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def packed_batch(*, micro_batch: int, seq_len: int, mean_doc: int, seed: int) -> torch.Tensor:
    """(B, T + 1) token ids: documents of geometric lengths (mean `mean_doc`), each ended by EOD."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, EOD_TOKEN, (micro_batch, seq_len + 1), generator=generator)
    ends = torch.rand(micro_batch, seq_len + 1, generator=generator) < 1.0 / mean_doc
    return tokens.masked_fill(ends, EOD_TOKEN)


def time_steps(model, batch: torch.Tensor, steps: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each of `steps` forward + backward passes (gradients cleared between).
    CPU time is this process's, all threads: on a shared machine it counts the work, not the wait
    for a core (spin-waiting threads count too, alike in both variants)."""
    times = []
    for _ in range(steps):
        wall, cpu = time.perf_counter(), time.process_time()
        model(batch[:, :-1], batch[:, 1:]).backward()
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
        model.zero_grad(set_to_none=True)
    return times


def measure(config: ModelConfig, batch: torch.Tensor, *, dtype: torch.dtype, rounds: int, steps: int) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) step seconds of masking off and on, interleaved (the order alternates by round)."""
    torch.manual_seed(0)
    model = build_model(config, "cpu").to(dtype).train()
    masking = DocumentMasking(eod_id=EOD_TOKEN)
    times: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    for variant in ("off", "on"):  # warm-up, untimed: first-call allocations
        model.documents = masking if variant == "on" else None
        time_steps(model, batch, 1)
    for round_index in range(rounds):
        for variant in ("off", "on") if round_index % 2 == 0 else ("on", "off"):
            model.documents = masking if variant == "on" else None
            times[variant] += time_steps(model, batch, steps)
    return {
        variant: (statistics.median(t[0] for t in values), statistics.median(t[1] for t in values))
        for variant, values in times.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raytrain_fast.bench.masking", description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--architecture", choices=("gpt", "llama"), default="gpt")
    parser.add_argument("--mean-doc", type=int, default=64, help="mean document length in tokens")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = ModelConfig(
        architecture=args.architecture, d_model=args.d_model, num_layers=args.layers, num_heads=args.heads,
        max_seq_len=args.seq_len, vocab_size=320,
    )
    batch = packed_batch(micro_batch=args.micro_batch, seq_len=args.seq_len, mean_doc=args.mean_doc, seed=0)
    for name in args.dtypes.split(","):
        median = measure(config, batch, dtype=DTYPES[name], rounds=args.rounds, steps=args.steps)
        record = {
            "architecture": args.architecture, "d_model": args.d_model, "layers": args.layers, "seq_len": args.seq_len,
            "micro_batch": args.micro_batch, "dtype": name, "threads": args.threads, "rounds": args.rounds,
            "steps": args.steps, "load_1min": round(os.getloadavg()[0], 1),
            "wall_off_ms": round(median["off"][0] * 1e3, 1), "wall_on_ms": round(median["on"][0] * 1e3, 1),
            "wall_on_over_off": round(median["on"][0] / median["off"][0], 3),
            "cpu_off_ms": round(median["off"][1] * 1e3, 1), "cpu_on_ms": round(median["on"][1] * 1e3, 1),
            "cpu_on_over_off": round(median["on"][1] / median["off"][1], 3),
        }
        say(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
