"""Config loading and validation: the messages users see before any worker starts."""

from __future__ import annotations

import re

import pytest

from raytrain_fast.config import Config, load_config, presets, validate
from raytrain_fast.errors import ConfigError

pytestmark = pytest.mark.unit


def write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_default_is_tiny_preset():
    config = load_config()
    assert config.name == "tiny"
    assert config.model.d_model == 128
    validate(config)


@pytest.mark.parametrize("preset", sorted(presets()))
def test_every_shipped_preset_loads_and_validates(preset):
    config = load_config(preset)
    validate(config)
    if config.train.micro_batch == "auto":  # the run measures it: the global batch must split over the workers
        assert config.train.global_batch % config.resources.num_workers == 0
    else:
        assert config.train.global_batch == config.batch().global_batch


def test_unknown_key_names_the_key_and_the_file(tmp_path):
    path = write(tmp_path, "model:\n  d_modle: 64\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert "model.d_modle" in message and "run.yaml" in message and "d_model" in message


def test_unknown_section_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'optimizer'"):
        load_config(write(tmp_path, "optimizer:\n  lr: 0.1\n"))


def test_duplicate_key_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="duplicate key 'steps'"):
        load_config(write(tmp_path, "train:\n  steps: 10\n  steps: 20\n"))


def test_wrong_types_are_all_reported_together(tmp_path):
    path = write(tmp_path, "train:\n  steps: ten\n  micro_batch: 2.5\nengine:\n  zero_stage: '2'\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert "3 problems" in message
    assert "train.steps: expected an integer, got 'ten'" in message
    assert "train.micro_batch" in message and "engine.zero_stage" in message


def test_scientific_notation_without_dot_is_a_number(tmp_path):
    # PyYAML reads 6e-4 as a string; users write it all the time.
    assert load_config(write(tmp_path, "optim:\n  lr: 6e-4\n")).optim.lr == pytest.approx(6e-4)


def test_set_overrides_are_typed_and_checked():
    config = load_config("tiny", ["train.steps=7", "model.positions=rotary", "train.grad_accum=null"])
    assert config.train.steps == 7 and config.model.positions == "rotary" and config.train.grad_accum is None
    with pytest.raises(ConfigError, match="unknown key 'train.stepz'"):
        load_config("tiny", ["train.stepz=7"])
    with pytest.raises(ConfigError, match="expected section.field=value"):
        load_config("tiny", ["train.steps"])
    with pytest.raises(ConfigError, match="must be one of 'learned', 'rotary'"):
        load_config("tiny", ["model.positions=alibi"])


def test_missing_config_file_and_unknown_preset_get_different_messages():
    with pytest.raises(ConfigError, match="--config file 'no-such-config.yaml' does not exist .*tiny"):
        load_config("no-such-config.yaml")
    with pytest.raises(ConfigError, match="'gpt-350' is not a preset .did you mean 'gpt-350m'"):
        load_config("gpt-350")


def test_old_preset_names_still_work_and_keep_their_run_name():
    assert load_config("gpt2-124m").to_dict() == {**load_config("gpt-124m").to_dict(), "name": "gpt2-124m"}


def test_bad_batch_arithmetic_names_fields_and_fix():
    config = load_config("tiny", ["train.global_batch=64", "train.micro_batch=8", "train.grad_accum=3", "resources.num_workers=2"])
    with pytest.raises(ConfigError) as error:
        validate(config)
    message = str(error.value)
    assert "train.global_batch (64) != micro_batch x grad_accum x num_workers (8 x 3 x 2 = 48)" in message
    assert "--set train.grad_accum=4" in message and "--set train.global_batch=48 (changes the training run)" in message
    _every_offered_fix_validates(message, ["train.global_batch=64", "train.micro_batch=8", "train.grad_accum=3",
                                           "resources.num_workers=2"])


def _every_offered_fix_validates(message: str, overrides: list[str]) -> None:
    """Each `--set ...` group after 'fix it with one of:' applied to the same overrides passes validation."""
    offered = message.split("fix it with one of: ", 1)[1].split("; ")
    assert len(offered) >= 2
    for fix in offered:
        changes = re.findall(r"--set (\S+=\S+)", fix)
        assert changes, fix
        validate(load_config("tiny", [*overrides, *changes]))


def test_derived_grad_accum_must_divide():
    config = load_config("tiny", ["train.global_batch=20", "train.micro_batch=8"])
    with pytest.raises(ConfigError, match=r"not a multiple of .* \(8 x 1 = 8\); fix it with one of: --set train.micro_batch=5 ") as error:
        validate(config)
    message = str(error.value)
    assert "--set train.micro_batch=4 --set train.grad_accum=5" in message and "--set train.global_batch=16" in message
    _every_offered_fix_validates(message, ["train.global_batch=20", "train.micro_batch=8"])
    readme_case = ["resources.num_workers=2"]  # tiny: micro_batch = global_batch = 16
    with pytest.raises(ConfigError) as error:
        validate(load_config("tiny", readme_case))
    _every_offered_fix_validates(str(error.value), readme_case)
    assert load_config("tiny", ["train.global_batch=32", "train.micro_batch=8", "resources.num_workers=2"]).batch().grad_accum == 2


def test_many_bad_values_in_one_message():
    config = load_config(
        "tiny",
        ["model.d_model=100", "model.num_heads=3", "train.steps=0", "optim.lr=-1", "data.seq_len=512", "engine.zero_stage=3"],
    )
    with pytest.raises(ConfigError) as error:
        validate(config)
    message = str(error.value)
    for expected in (
        "model.d_model (100) must be divisible by model.num_heads (3)",
        "train.steps must be > 0, got 0",
        "optim.lr must be > 0",
        "data.seq_len (512) exceeds model.max_seq_len (128)",
        "engine.zero_stage must be 0, 1 or 2",
    ):
        assert expected in message


def test_every_section_is_checked_and_problems_come_in_section_order():
    config = load_config("tiny", [
        "checkpoint.keep_last=0", "model.dropout=1.5", "data.max_tokens=-1", "optim.min_lr_ratio=2",
        "engine.reduce_bucket_size=0", "train.global_batch=30", "resources.max_failures=-2",
        "metrics.queue_size=0", "checkpoint.keep_best=-1",
    ])
    with pytest.raises(ConfigError) as error:
        validate(config)
    expected = [
        "checkpoint.keep_last must be > 0", "model.dropout must be in [0, 1)", "data.max_tokens must be >= 0",
        "optim.min_lr_ratio must be in [0, 1]", "engine.reduce_bucket_size must be > 0",
        "train.global_batch (30) is not a multiple", "resources.max_failures must be -1",
        "metrics.queue_size must be > 0", "checkpoint.keep_best must be >= 0",
    ]
    found = [next((i for i, problem in enumerate(error.value.problems) if problem.startswith(e)), None) for e in expected]
    assert None not in found, (expected, error.value.problems)
    assert found == sorted(found) and len(error.value.problems) == len(expected)


def _problems(*overrides: str) -> list[str]:
    try:
        validate(load_config("tiny", list(overrides)))
    except ConfigError as error:
        return error.problems
    return []


def test_the_lr_schedule_fields_are_checked_with_the_field_and_a_fix():
    assert _problems("optim.schedule=wsd", "train.steps=100", "optim.decay_steps=30") == []
    assert _problems("optim.schedule=constant") == []
    with pytest.raises(ConfigError, match="optim.schedule: must be one of 'cosine', 'wsd', 'constant', got 'linear'"):
        load_config("tiny", ["optim.schedule=linear"])
    with pytest.raises(ConfigError, match="optim.decay_shape: must be one of 'linear', 'cosine', 'sqrt'"):
        load_config("tiny", ["optim.decay_shape=exp"])
    assert _problems("optim.schedule=wsd", "optim.decay_steps=0", "optim.decay_fraction=0") == [
        "optim.decay_steps must be >= 1 (or null: optim.decay_fraction of train.steps), got 0",
        "optim.decay_fraction must be in (0, 1] (the wsd decay's share of train.steps), got 0.0",
    ]
    # A decay set for another schedule would be ignored: refused, naming both ways out.
    [ignored] = _problems("optim.decay_steps=10")
    assert "optim.decay_steps (10) is only used by optim.schedule=wsd" in ignored
    assert "--set optim.schedule=wsd" in ignored and "--set optim.decay_steps=null" in ignored


@pytest.mark.parametrize("overrides", [
    ("optim.decay_steps=90",), ("optim.decay_fraction=0.95",), ("optim.decay_fraction=0.85",),
])
def test_a_wsd_decay_reaching_into_the_warmup_is_refused_with_a_fix_that_validates(overrides):
    base = ["optim.schedule=wsd", "train.steps=100", "optim.warmup_steps=20"]
    [problem] = _problems(*base, *overrides)
    assert "exceed train.steps (100): the wsd decay would start inside the warmup" in problem
    fix = re.search(r"fix: --set (\S+),", problem).group(1)
    assert fix.split("=")[0] == overrides[0].split("=")[0]
    assert _problems(*base, fix) == []  # the suggested value fits


def test_cluster_checks_gpu_and_cpu_requests():
    gpu = load_config("tiny", ["resources.use_gpu=true"])
    with pytest.raises(ConfigError, match="use_gpu=true with 1 workers, but the Ray cluster has 0 GPUs"):
        validate(gpu, cluster_cpus=2, cluster_gpus=0)
    cpus = load_config("tiny", ["resources.cpus_per_worker=4", "resources.num_workers=2", "train.global_batch=32"])
    with pytest.raises(ConfigError, match="8 CPUs, but the Ray cluster has 2; the workers would wait forever"):
        validate(cpus, cluster_cpus=2, cluster_gpus=0)


def test_missing_data_source_and_bad_name():
    config = load_config("tiny", ["data.source=/no/such/corpus", "name=bad name!"])
    with pytest.raises(ConfigError) as error:
        validate(config)
    assert "data.source '/no/such/corpus' does not exist" in str(error.value)
    assert "name 'bad name!'" in str(error.value)


def test_round_trip_through_dict_keeps_every_value():
    config = load_config("gpt2-124m", ["train.steps=5"], name="x")
    assert Config.from_dict(config.to_dict()) == config


def test_config_error_pickles_across_actors():
    import pickle

    error = ConfigError(["a", "b"], source="f.yaml")
    copy = pickle.loads(pickle.dumps(error))
    assert copy.problems == ["a", "b"] and str(copy) == str(error)


def test_a_resume_names_every_changed_optim_setting_in_one_line_and_refuses_none():
    from raytrain_fast.launch.run_changes import check_run_unchanged

    saved = load_config("tiny", ["optim.lr=0.001"]).to_dict()
    del saved["optim"]["schedule"]  # a checkpoint from before the schedules: it trained with cosine
    current = load_config("tiny", ["optim.lr=0.0005", "optim.schedule=wsd", "optim.beta2=0.99"]).to_dict()
    lines = check_run_unchanged(saved, current, allow_changes="", name="tiny", step=100, checkpoint="c")
    assert lines == [
        "Resuming at step 100 with changed optimizer settings, in effect from this step on: "
        "optim.lr: 0.001 -> 0.0005; optim.schedule: 'cosine' -> 'wsd'; optim.beta2: 0.95 -> 0.99"
    ]
    assert check_run_unchanged(saved, load_config("tiny", ["optim.lr=0.001"]).to_dict(), allow_changes="", name="tiny",
                               step=100, checkpoint="c") == []  # the missing key was the default: no change
    finished = check_run_unchanged(saved, current, allow_changes="", name="tiny", step=current["train"]["steps"], checkpoint="c")
    assert finished == []  # the run has nothing left to do: no step trains with the changes, none is announced
