"""`raytrain-fast bench model` end to end on the tiny preset, through the command line: the variants
(eager only: compiling on 2 CPU cores takes ~40 s and more) share precision, threads, shape and timed
window, the ratios share one baseline and MFU one FLOPs count and peak, stdout is the JSON alone, and full activation
checkpointing shows up in the memory above setup at a size where activations dominate (seq 256 x
micro-batch 16 at d_model 128: ~70 MB of activations without it, next to ~0.5 GB of process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from raytrain_fast.bench.model import VARIANTS, parse_variants
from raytrain_fast.cli import build_parser
from raytrain_fast.errors import ConfigError

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

CHOSEN = ["bare", "engine", "engine_ac"]
COMMAND = [
    "bench", "model", "--preset", "tiny", "--seq-len", "256", "--micro-batch", "16", "--steps", "4", "--rounds", "2",
    "--warmup-steps", "1", "--variants", ",".join(CHOSEN), "--peak-seconds", "0.3", "--json",
]


@pytest.fixture(scope="module")
def report() -> dict:
    done = subprocess.run([sys.executable, "-m", "raytrain_fast.cli", *COMMAND], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "[bench model] round 2/2" in done.stderr  # progress goes to stderr
    return json.loads(done.stdout)  # stdout is the JSON object and nothing else


def test_every_variant_ran_the_same_setup_and_the_same_window(report):
    assert list(report["variants"]) == CHOSEN
    assert report["preset"] == "tiny" and report["seq_len"] == 256 and report["micro_batch"] == 16
    assert report["precision"] in ("bf16", "fp32") and report["threads"] >= 1
    assert sum(report["steps_per_round"]) == report["steps"] == 4 and report["rounds"] == 2
    # Interleaved: every round runs every variant, the order rotated between rounds.
    assert report["order"][0] == CHOSEN and report["order"][1] == CHOSEN[1:] + CHOSEN[:1]
    for name, entry in report["variants"].items():
        # What each variant's own process recorded, not the parent's intent.
        assert (entry["precision"], entry["threads"], entry["seq_len"], entry["micro_batch"]) == (
            report["precision"], report["threads"], 256, 16), name
        assert entry["timed_steps"] == report["steps"] and entry["warmup_steps"] == 1, name
        assert len(entry["round_tokens_per_sec"]) == 2, name
        assert entry["tokens_per_sec"] > 0 and entry["timed_s"] > 0, name
        # One rate over the whole timed window: it lies between the rounds' own rates.
        assert min(entry["round_tokens_per_sec"]) * 0.999 <= entry["tokens_per_sec"] <= max(entry["round_tokens_per_sec"]) * 1.001, name
        assert entry["final_loss"] == entry["final_loss"] and 0 < entry["final_loss"] < 20, name  # finite
        assert entry["peak_gb"] > 0 and entry["setup_gb"] > 0 and entry["above_setup_gb"] >= 0, name
        assert entry["setup_gb"] <= entry["peak_gb"], name  # the timed steps' peak holds what setup left
        assert "compile_s" not in entry, name
    expected_ac = {"bare": "none", "engine": "none", "engine_ac": "full"}
    assert {name: e["activation_checkpointing"] for name, e in report["variants"].items()} == expected_ac


def test_ratios_share_one_baseline_and_mfu_one_flops_count_and_one_peak(report):
    variants = report["variants"]
    assert variants["bare"]["ratio_vs_bare"] == 1.0
    speed_order = sorted(variants, key=lambda name: variants[name]["tokens_per_sec"])
    assert sorted(variants, key=lambda name: variants[name]["ratio_vs_bare"]) == speed_order
    # Every variant's MFU uses the same FLOPs per token and the same peak: MFU per token/s is one number.
    per_token = [entry["mfu"] / entry["tokens_per_sec"] for entry in variants.values()]
    assert max(per_token) == pytest.approx(min(per_token), rel=1e-9)
    assert all(0 < entry["mfu"] < 1 for entry in variants.values())  # above 1: the FLOPs or the peak are wrong
    # The FLOPs count (eager, no recomputation) agrees with the formula MFU uses.
    assert report["counted_flops_per_token"] == pytest.approx(report["flops_per_token"], rel=0.1)
    cut = report["ac_memory_cut"]
    assert list(cut) == ["eager"]  # no compiled pair was run
    slower = variants["engine_ac"]["tokens_per_sec"] < variants["engine"]["tokens_per_sec"]
    assert (cut["eager"]["tokens_per_sec_ratio"] < 1) == slower
    smaller = variants["engine_ac"]["peak_gb"] < variants["engine"]["peak_gb"]
    assert (cut["eager"]["peak_gb_cut"] > 0) == smaller


def test_full_activation_checkpointing_cuts_the_memory_above_setup(report):
    variants = report["variants"]
    assert variants["engine_ac"]["above_setup_gb"] < variants["engine"]["above_setup_gb"]
    assert report["ac_memory_cut"]["eager"]["above_setup_gb_cut"] > 0


@pytest.mark.unit
def test_a_bad_variant_name_names_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", "model", "--variants", "bare,engine_fast"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--variants" in err and "'engine_fast'" in err
    assert all(name in err for name in VARIANTS)
    with pytest.raises(ConfigError, match="valid: bare, engine, engine_ac, engine_compiled, engine_compiled_ac"):
        parse_variants([])
    assert parse_variants(" engine_ac,bare,engine_ac ") == ["engine_ac", "bare"]
