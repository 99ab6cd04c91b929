"""`raytrain-fast bench model` end to end on the tiny preset, through the command line: the variants
(eager only: compiling on 2 CPU cores takes ~40 s and more) share precision, threads, shape and timed
window, the ratios and MFU are what the numbers say, stdout is the JSON alone, and full activation
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
        assert entry["tokens_per_sec"] == pytest.approx(entry["timed_steps"] * 16 * 256 / entry["timed_s"]), name
        assert entry["final_loss"] == entry["final_loss"] and 0 < entry["final_loss"] < 20, name  # finite
        assert entry["peak_gb"] > 0 and entry["setup_gb"] > 0 and entry["above_setup_gb"] >= 0, name
        assert entry["above_setup_gb"] == pytest.approx(entry["peak_gb"] - entry["setup_gb"]), name
        assert "compile_s" not in entry, name
    expected_ac = {"bare": "none", "engine": "none", "engine_ac": "full"}
    assert {name: e["activation_checkpointing"] for name, e in report["variants"].items()} == expected_ac


def test_ratios_and_mfu_are_what_the_numbers_say(report):
    variants = report["variants"]
    bare = variants["bare"]["tokens_per_sec"]
    for name, entry in variants.items():
        assert entry["ratio_vs_bare"] == pytest.approx(entry["tokens_per_sec"] / bare, rel=1e-12), name
        assert entry["mfu"] == pytest.approx(
            entry["tokens_per_sec"] * report["flops_per_token"] / (report["peak_tflops"] * 1e12), rel=1e-9), name
    assert variants["bare"]["ratio_vs_bare"] == 1.0
    # The FLOPs count (eager, no recomputation) agrees with the formula MFU uses.
    assert report["counted_flops_per_token"] == pytest.approx(report["flops_per_token"], rel=0.1)
    cut = report["ac_memory_cut"]
    assert list(cut) == ["eager"]  # no compiled pair was run
    assert cut["eager"]["tokens_per_sec_ratio"] == pytest.approx(
        variants["engine_ac"]["tokens_per_sec"] / variants["engine"]["tokens_per_sec"])
    assert cut["eager"]["peak_gb_cut"] == pytest.approx(1 - variants["engine_ac"]["peak_gb"] / variants["engine"]["peak_gb"])


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
