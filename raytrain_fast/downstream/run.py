"""eval.tasks for a training run, on the driver: the tasks read as soon as the config is checked (an
unknown name or a malformed line fails in a second), then encoded with the prepared data's tokenizer
for the run's model (a tokenizer that cannot encode an item fails there), all before any worker starts."""

from __future__ import annotations

import dataclasses

from raytrain_fast.config import Config
from raytrain_fast.config.model import ModelConfig
from raytrain_fast.config.storage import StorageConfig
from raytrain_fast.data.manifest import Manifest
from raytrain_fast.data.tokenizer import TokenizerSpec
from raytrain_fast.downstream.encode import Encoder, encode_tasks, skipped_note
from raytrain_fast.downstream.in_loop import RunTasks
from raytrain_fast.downstream.tasks import Task, TaskError, load_tasks


def load_run_tasks(config: Config) -> list[Task]:
    """eval.tasks read (none: []); TaskError for an unknown task or a bad file."""
    if not config.eval.tasks:
        return []
    try:
        return load_tasks(list(config.eval.tasks), limit=config.eval.task_limit)
    except TaskError as error:
        raise TaskError(f"eval.tasks: {error}") from None


def encoder_for(spec: TokenizerSpec, model: ModelConfig) -> Encoder:
    """Our tokenizer (byte or a tokenizers file) for a model of ours."""
    return Encoder(
        encode=spec.encode_text, eod_id=spec.info.eod_id, vocab_size=model.vocab_size, window=model.max_seq_len,
        unknown_id=spec.unknown_id, bos_id=spec.info.bos_id, name=spec.info.name,
    )


def manifest_tokenizer(manifest: Manifest, storage: StorageConfig) -> TokenizerSpec:
    """The tokenizer the prepared data was made with, checked to be the same file still."""
    from raytrain_fast.data.tokenizer import load_tokenizer

    recorded = manifest.tokenizer
    spec = load_tokenizer(recorded.name, storage)
    if spec.info.hash != recorded.hash:
        raise TaskError(
            f"eval.tasks: the tokenizer {recorded.name} changed since the data was prepared (sha256 {spec.info.hash[:12]}, "
            f"the data manifest says {recorded.hash[:12]}), so the tasks cannot be encoded as the model reads text: "
            "prepare the data again with it, or restore the file"
        )
    return dataclasses.replace(spec, info=recorded)  # the manifest says how documents start (bos_id)


def encode_run_tasks(tasks: list[Task], config: Config, manifest: Manifest, *, every_steps: int) -> tuple[RunTasks | None, list[str]]:
    """(the tasks encoded for the run's model, lines to print), or (None, []) without tasks."""
    if not tasks:
        return None, []
    encoder = encoder_for(manifest_tokenizer(manifest, config.storage), config.model)
    encoded = encode_tasks(tasks, encoder)
    empty = [task.name for task in encoded if task.num_items == 0]
    if empty:
        raise TaskError(
            f"eval.tasks: no item of {', '.join(empty)} fits the model's window of {encoder.window} tokens (a choice alone is "
            "longer): leave the task out, or train a model with a larger model.max_seq_len"
        )
    run_tasks = RunTasks(tasks=encoded, window=encoder.window)
    return run_tasks, [run_tasks.note(every_steps), *skipped_note(encoded, encoder.window)]
