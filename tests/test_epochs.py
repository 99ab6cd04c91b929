"""Epochs: a counter on the progress line, a warning at start and a report finding
when a small corpus is repeated many times."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from raytrain_fast.data.corpus import MANY_EPOCHS, repetition_warning
from raytrain_fast.report import diagnose, from_records
from tests.test_report import CONFIG, records

pytestmark = pytest.mark.unit


def test_epochs_come_from_the_data_position():
    import numpy as np

    from raytrain_fast.data.ingest import BatchIterator

    at = lambda given: BatchIterator.epochs.fget(  # noqa: E731 - the most repeated source's passes
        SimpleNamespace(given=lambda: given, names=["a", "b"], source_sizes=np.asarray([94, 10]))
    )
    assert at({"a": 0, "b": 0}) == 0.0 and at({"a": 235, "b": 5}) == 2.5 and at({"a": 94, "b": 530, "gone": 9}) == 53.0


def test_progress_line_shows_the_epoch():
    from raytrain_fast.metrics.progress import progress_line

    metrics = {"train/loss": 1.5, "train/lr": 1e-3, "train/epoch": 2.5, "time/step_s": 0.1,
               "throughput/tokens_per_sec": 1000.0, "time/data_wait_frac": 0.01}
    line = progress_line(10, 40, metrics, {})
    assert line.startswith("step 10/40  epoch 2.50  loss 1.5000"), line


def test_warning_when_the_corpus_would_be_repeated_many_times():
    # The trial: 94 sequences (an 11 KB file), 300 steps of 16: ~51 passes.
    warning = repetition_warning(sequences_per_epoch=94, steps=300, global_batch=16)
    assert warning is not None and "51 times" in warning and "data.source" in warning
    assert repetition_warning(sequences_per_epoch=94 * 100, steps=300, global_batch=16) is None  # ~0.5 epochs
    assert repetition_warning(sequences_per_epoch=1200, steps=300, global_batch=16) is None  # exactly 4: allowed


def test_report_finds_a_corpus_repeated_many_times():
    def epochs(factor):
        def tweak(i, r):
            r["train/epoch"] = factor * (i + 1)
        return tweak

    repeated = diagnose(from_records(records(tweak=epochs(3.3)), config=CONFIG))  # 16 windows: ~53 epochs
    finding = next(f for f in repeated.findings if f.key == "corpus_repeated")
    assert finding.numbers["epochs"] > 50 and "53" in finding.title
    few = diagnose(from_records(records(tweak=epochs(MANY_EPOCHS / 16)), config=CONFIG))
    assert all(f.key != "corpus_repeated" for f in few.findings)


def test_the_small_corpus_advice_names_the_runs_own_data_setting_and_a_split_only_when_it_lacks_one():
    def repeated(with_val: bool):
        def tweak(i, r):
            r["train/epoch"] = 3.3 * (i + 1)
            if with_val:
                r["val/loss"] = 3.0
        return tweak

    def advice(config: dict, *, with_val: bool) -> str:
        found = diagnose(from_records(records(tweak=repeated(with_val)), config=config)).findings
        return " ".join(next(f for f in found if f.key == "corpus_repeated").advice)

    mixture = {**CONFIG, "data": {"sources": [{"source": "code", "weight": 0.5}, {"source": "notes", "weight": 0.5}]}}
    said = advice(mixture, with_val=True)
    assert "data.sources" in said and "data.source)" not in said and "validation split" not in said, said
    said = advice(CONFIG, with_val=False)
    assert "a larger corpus (data.source)" in said and "keep a validation split (prepare-data --val-fraction)" in said, said


def test_the_loss_plot_draws_each_sources_val_loss_of_a_mixture():
    from matplotlib.figure import Figure

    from raytrain_fast.report.plots import _loss

    def evaluated(i, r):
        r.update({"val/loss": 3.0 - 0.1 * i, "val/loss/code": 2.5 - 0.1 * i, "val/loss/notes": 3.5 - 0.1 * i})

    axis = Figure().subplots()
    assert _loss(from_records(records(tweak=evaluated), config=CONFIG), axis) is None
    _, labels = axis.get_legend_handles_labels()
    assert {"train/loss", "val/loss (held out)", "val/loss/code", "val/loss/notes"} <= set(labels), labels
