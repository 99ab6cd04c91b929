"""Export a run's checkpoint as plain model weights: `model.safetensors` + `config.yaml` (format
native), or the Hugging Face format (format hf: checkpoint/hf_export.py).

The weights come from the fp32 master copy in the ZeRO optimizer shards when present (DeepSpeed's
zero_to_fp32 consolidates them across ranks), else from rank 0's module weights (ZeRO stage 0,
or a checkpoint saved without optimizer state). The model config comes from the checkpoint's own
`config.yaml` (the run config, `model` section). The checkpoint is downloaded and verified against
its manifests first: an incomplete or altered checkpoint is never exported.

Tied embeddings: safetensors refuses tensors that share memory, so `save_model` stores the shared
matrix once; `load_exported` builds the GPT (which ties lm_head to token_emb) and loads into it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Literal

import yaml

from raytrain_fast.checkpoint.layout import CONFIG_FILE, DEEPSPEED_TAG
from raytrain_fast.checkpoint.download import download_checkpoint, find_resumable_checkpoint
from raytrain_fast.checkpoint.verify import list_checkpoint_dirs, saved_state
from raytrain_fast.console import say
from raytrain_fast.errors import CheckpointError
from raytrain_fast.model import GPT, ModelConfig, model_class
from raytrain_fast.config.storage import StorageConfig
from raytrain_fast.storage.filesystem import resolve_filesystem, uri_of

WEIGHTS_FILE = "model.safetensors"
# An export writes its config.yaml under the same name as the run config in a checkpoint
# (CONFIG_FILE): both hold a `model` section, read by _model_config_from_dict.
DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
"""Both spellings, the config's (bf16, fp32) and torch's (bfloat16, float32), are accepted."""


def _model_config_from_dict(data: Any, *, source: str) -> ModelConfig:
    from raytrain_fast._dataclass_yaml import from_dict

    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise CheckpointError(f"{source} has no 'model' section")
    problems: list[str] = []
    config = from_dict(ModelConfig, data["model"], path="model", problems=problems)
    if problems:
        raise CheckpointError(f"{source}: the model section does not fit this version's ModelConfig: {'; '.join(problems)}")
    return config


def read_checkpoint_model_config(local_dir: str) -> ModelConfig | None:
    """The ModelConfig in a downloaded checkpoint's config.yaml, or None if it has none."""
    path = Path(local_dir, CONFIG_FILE)
    if not path.exists():
        return None
    return _model_config_from_dict(yaml.safe_load(path.read_text()), source=f"the checkpoint's {CONFIG_FILE}")


def _pass_on_without_progress_bars(text: str) -> None:
    """Write `text` to stderr without tqdm's bar redraws (lines of \\r-separated frames with '|')."""
    for line in text.replace("\r", "\n").splitlines():
        if line.strip() and not re.search(r"\d+%\|", line):
            say(line, stderr=True)


def consolidated_state_dict(local_dir: str) -> tuple[dict[str, Any], str]:
    """(full fp32 state dict, where the weights came from) from a downloaded checkpoint."""
    from raytrain_fast.engine import select_accelerator

    if not Path(local_dir, DEEPSPEED_TAG).is_dir():
        raise CheckpointError(f"checkpoint has no DeepSpeed directory '{DEEPSPEED_TAG}/'")
    select_accelerator()  # DeepSpeed reads DS_ACCELERATOR once, at its first import
    from raytrain_fast.engine.deepspeed_compat import saved_weights

    # DeepSpeed prints a line per parameter group and draws tqdm bars ("Loading checkpoint shards") on
    # stderr; anything else it writes there (a warning) is passed on.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        found = saved_weights(local_dir, tag=DEEPSPEED_TAG)
    _pass_on_without_progress_bars(err.getvalue())
    if found is None:
        raise CheckpointError("checkpoint has neither ZeRO optimizer shards nor rank 0's module weights")
    return found


def export_format(config: ModelConfig, format: str) -> Literal["native", "hf"]:
    """`auto` resolved: hf for llama, native (model.safetensors + config.yaml) for the GPT."""
    if format not in ("auto", "native", "hf"):
        raise CheckpointError(f"--format '{format}': use auto, native or hf")
    if format == "auto":
        return "hf" if config.architecture == "llama" else "native"
    return format  # type: ignore[return-value]


def export_local_checkpoint(
    local_dir: str,
    out_dir: str,
    *,
    model_config: ModelConfig | None = None,
    dtype: Literal["float32", "bfloat16"] = "float32",
    metadata: dict[str, Any] | None = None,
    format: Literal["auto", "native", "hf"] = "auto",
    storage: StorageConfig | None = None,
    tokenizer: str | None = None,
    max_shard_bytes: int | None = None,
) -> str:
    """Write model.safetensors + config.yaml (format native), or the Hugging Face files (format hf,
    see checkpoint/hf_export.py; config.yaml then records the export only), into out_dir from an
    already downloaded checkpoint. auto = hf for llama, native for the GPT.

    dtype: float32 / fp32 or bfloat16 / bf16 (the config's spelling). tokenizer: the tokenizer.json
    to export instead of the run's (hf only)."""
    config = read_checkpoint_model_config(local_dir) or model_config
    if config is None:
        raise CheckpointError(
            f"the checkpoint has no {CONFIG_FILE} with the model config (saved by an older version?): "
            "pass model_config= with the run's model settings"
        )
    chosen = export_format(config, format)
    if chosen == "hf":
        from raytrain_fast.checkpoint.hf_export import hf_refusal, run_tokenizer

        if hf_refusal(config):
            raise CheckpointError(f"cannot export in the Hugging Face format: {hf_refusal(config)}")
        spec = run_tokenizer(read_run_config(local_dir), storage, tokenizer)  # before the slow part: it can refuse
    dtype = _checked_dtype(dtype)
    model, source = _checkpoint_model(local_dir, config, dtype=dtype)
    os.makedirs(out_dir, exist_ok=True)
    info = {"weights": source, "dtype": dtype, "format": chosen, **(metadata or {}), **_losses_at_save(local_dir),
            **_run_tasks(read_run_config(local_dir))}
    if chosen == "hf":
        from raytrain_fast.checkpoint.hf_export import DEFAULT_MAX_SHARD_BYTES, write_hf_export

        info["files"] = write_hf_export(
            model.state_dict(), config, out_dir, tokenizer=spec, dtype=dtype,
            max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES,
        )
        info["tokenizer"] = spec.info.name
    else:
        from safetensors.torch import save_model

        # safetensors' header metadata holds strings only; config.yaml keeps the types (step: 300).
        metadata = {k: str(v) for k, v in info.items() if not isinstance(v, (list, dict))}
        save_model(model, str(Path(out_dir, WEIGHTS_FILE)), metadata=metadata)
    config_path = Path(out_dir, CONFIG_FILE)
    config_path.write_text(yaml.safe_dump({"model": dataclasses.asdict(config), "export": info}, sort_keys=False))
    if chosen == "native":  # safetensors creates its file 0600: give it config.yaml's mode (the umask's)
        os.chmod(Path(out_dir, WEIGHTS_FILE), stat.S_IMODE(config_path.stat().st_mode))
    return out_dir


def _checked_dtype(dtype: str) -> Literal["float32", "bfloat16"]:
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in ("float32", "bfloat16"):
        raise CheckpointError(f"dtype '{dtype}': use one of {', '.join(DTYPE_ALIASES)}")
    return dtype  # type: ignore[return-value]


def _checkpoint_model(local_dir: str, config: ModelConfig, *, dtype: str) -> tuple[Any, str]:
    """The model of `config` holding the checkpoint's consolidated weights, in `dtype`; and where the weights came from."""
    import torch

    state, source = consolidated_state_dict(local_dir)
    model = model_class(config)(config)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as error:
        raise CheckpointError(f"the checkpoint's weights do not fit its model config: {error}") from None
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    return model, source


def read_run_config(local_dir: str) -> dict[str, Any]:
    """The config.yaml in `local_dir` (a checkpoint's or an export's) as a dict ({} when it has none)."""
    path = Path(local_dir, CONFIG_FILE)
    try:
        data = yaml.safe_load(path.read_text()) if path.exists() else None
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _run_tasks(run_config: dict[str, Any]) -> dict[str, Any]:
    """The run's eval.tasks and task_limit, kept with an export so that `evaluate` of it scores what
    `evaluate` of the run scores ({} for a run without tasks)."""
    section = run_config.get("eval") or {}
    return {"eval": {"tasks": section["tasks"], "task_limit": section.get("task_limit")}} if section.get("tasks") else {}


def exported_eval_section(out_dir: str) -> dict[str, Any]:
    """The run's eval.tasks and task_limit from an export's config.yaml ({} when it has none)."""
    section = (read_run_config(out_dir).get("export") or {}).get("eval")
    return section if isinstance(section, dict) else {}


def _losses_at_save(local_dir: str) -> dict[str, float]:
    """The exported step's val/loss and train/loss as saved with the checkpoint (those it has)."""
    import pyarrow.fs as pafs

    metrics = saved_state(pafs.LocalFileSystem(), local_dir).get("metrics") or {}
    return {name.replace("/", "_"): float(metrics[name]) for name in ("val/loss", "train/loss") if name in metrics}


def export_checkpoint(
    *,
    storage_uri: str,
    storage: StorageConfig,
    name: str,
    step: int | None,
    out_dir: str,
    model_config: ModelConfig | None = None,
    dtype: Literal["float32", "bfloat16", "fp32", "bf16"] = "float32",
    overwrite: bool = False,
    format: Literal["auto", "native", "hf"] = "auto",
    tokenizer: str | None = None,
    max_shard_bytes: int | None = None,
) -> str:
    """Export run `name`'s checkpoint at `step` (None = the newest complete one) to out_dir (local).

    Returns out_dir, which then holds model.safetensors and config.yaml (format native, see
    load_exported) or the Hugging Face files (format hf, see export_local_checkpoint); the
    config's `export` section records the step (an int) and every newer checkpoint skipped, with why.
    Raises CheckpointError when the run has no such checkpoint or it is incomplete, and when out_dir
    already holds an export, unless overwrite.
    """
    from raytrain_fast.checkpoint.hf_export import HF_FILES

    existing = [f for f in dict.fromkeys((WEIGHTS_FILE, CONFIG_FILE, *HF_FILES)) if Path(out_dir, f).exists()]
    if existing and not overwrite:
        raise CheckpointError(
            f"{out_dir} already holds {' and '.join(existing)}: pass --overwrite to replace them, or choose another --out"
        )
    filesystem, root = resolve_filesystem(storage_uri, storage)
    run_path = f"{root.rstrip('/')}/{name}"
    local_dir = tempfile.mkdtemp(prefix="raytrain-fast-export-")
    try:
        path, skipped = download_chosen(filesystem, run_path, local_dir, name=name, step=step, storage_uri=storage_uri)
        checkpoint_step = int(path.rstrip("/").rsplit("_", 1)[-1])
        with _staged(out_dir) as staging:
            export_local_checkpoint(
                local_dir, staging, model_config=model_config, dtype=dtype, format=format, storage=storage,
                tokenizer=tokenizer, max_shard_bytes=max_shard_bytes,
                metadata={
                    "run": name, "step": checkpoint_step, "checkpoint": uri_of(path, like=storage_uri),
                    "skipped": [{"checkpoint": p.rsplit("/", 1)[-1], "reason": r} for p, r in skipped],
                },
            )
        return out_dir
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)


_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _is_export_file(name: str) -> bool:
    from raytrain_fast.checkpoint.hf_export import HF_FILES

    return name in {WEIGHTS_FILE, CONFIG_FILE, *HF_FILES, "tokenizer_config.json", "special_tokens_map.json"} or bool(
        _SHARD_FILE.fullmatch(name)
    )


@contextlib.contextmanager
def _staged(out_dir: str):
    """A new folder for the export's files, moved into place once every one is written: a failure
    (or Ctrl-C) leaves nothing behind and `out_dir` as it was. A new out_dir: the folder, beside it,
    is renamed to it. An existing one (it may hold other files: `--out .`): the folder is made inside
    it, the earlier export's files are removed and the new ones moved in."""
    out = Path(out_dir).expanduser().absolute()
    exists = out.is_dir()
    parent = out if exists else out.parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = parent / f".{out.name or 'export'}.partial-{os.getpid()}-{os.urandom(4).hex()}"
    staging.mkdir()  # the umask's mode, as a directory made by hand
    try:
        yield str(staging)
        if not exists:
            staging.rename(out)
            return
        for old in [p for p in out.iterdir() if p.is_file() and _is_export_file(p.name)]:
            old.unlink()
        for new in staging.iterdir():
            new.rename(out / new.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def download_chosen(
    filesystem: Any, run_path: str, local_dir: str, *, name: str, step: int | None, storage_uri: str
) -> tuple[str, list[tuple[str, str]]]:
    """Download the checkpoint at `step` (None: the newest complete one) into local_dir: (its path,
    [(newer checkpoint skipped, why), ...])."""
    if step is None:
        path, skipped = find_resumable_checkpoint(filesystem, run_path, download_to=local_dir)
        if path is None:
            why = "; ".join(f"{p.rsplit('/', 1)[-1]}: {r}" for p, r in skipped) or "it has no checkpoints"
            raise CheckpointError(
                f"run '{name}' under {storage_uri} has no complete checkpoint ({why}). Check --name and --storage "
                f"(`raytrain-fast runs --storage {storage_uri}` lists runs), or train it until it saves one"
            )
        return path, skipped
    steps = [s for s, _ in list_checkpoint_dirs(filesystem, run_path)]
    if step not in steps:
        raise CheckpointError(
            f"run '{name}' under {storage_uri} has no checkpoint at step {step} (steps: {sorted(steps) or 'none'}); "
            "pick one of those steps, or leave out --step for the newest complete one"
        )
    path = f"{run_path}/checkpoint_{step:08d}"
    download_checkpoint(filesystem, path, local_dir)
    return path, []


def load_exported(out_dir: str, *, device: str = "cpu") -> GPT:
    """The model (GPT or Llama) saved by export_checkpoint with format native, in eval mode (tied
    embeddings tied again)."""
    from safetensors.torch import load_model

    config_path = Path(out_dir, CONFIG_FILE)
    if not config_path.exists():
        raise CheckpointError(f"{out_dir} has no {CONFIG_FILE}: not an exported model")
    data = yaml.safe_load(config_path.read_text())
    config = _model_config_from_dict(data, source=str(config_path))
    if (data.get("export") or {}).get("format") == "hf":
        raise CheckpointError(
            f"{out_dir} is a Hugging Face export: load it with transformers' AutoModelForCausalLM.from_pretrained({out_dir!r})"
        )
    model = model_class(config)(config)
    load_model(model, str(Path(out_dir, WEIGHTS_FILE)), strict=True, device=device)
    return model.to(device).eval()
