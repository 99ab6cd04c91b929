"""`checkpoint.init_from` of a Hugging Face directory: a Llama-family `config.json` and its
safetensors weights (one file, or shards with `model.safetensors.index.json`), local or s3://.

Told apart from our own checkpoints by its config.json (ours hold config.yaml and manifests). The
driver reads config.json before any worker starts and refuses a model that differs from the run's
(`init_from_problems`, every differing field in one message); on the workers, rank 0 reads and
converts the weights (`read_hf_weights`, model/hf.py), then broadcasts them as for our checkpoints.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow.fs as pafs

from raytrain_fast.errors import CheckpointError
from raytrain_fast.model import ModelConfig
from raytrain_fast.model.hf import from_hf_llama, model_differences, model_fields_from_hf, to_hf_state_dict

HF_CONFIG = "config.json"
HF_INDEX = "model.safetensors.index.json"


def read_hf_config(filesystem: pafs.FileSystem, path: str) -> dict[str, Any] | None:
    """The config.json of a Hugging Face directory at `path`, or None when `path` has none."""
    target = f"{path.rstrip('/')}/{HF_CONFIG}"
    if filesystem.get_file_info(target).type != pafs.FileType.File:
        return None
    with filesystem.open_input_stream(target) as stream:
        try:
            data = json.loads(stream.read())
        except ValueError as error:
            raise CheckpointError(f"{target} is not valid JSON: {error}") from None
    return data if isinstance(data, dict) else None


def init_from_problems(uri: str, model: ModelConfig, storage: Any) -> list[str]:
    """Why the Hugging Face model at `uri` cannot initialise `model` ([] when it can, or when `uri`
    is not a Hugging Face directory: our checkpoints are checked by the workers as before)."""
    from raytrain_fast.storage import resolve_filesystem

    filesystem, path = resolve_filesystem(uri, storage)
    try:
        hf = read_hf_config(filesystem, path)
    except OSError as error:
        return [f"checkpoint.init_from={uri} cannot be read: {error}"]
    if hf is None:
        return []
    try:
        fields = model_fields_from_hf(hf)
    except (ValueError, KeyError, TypeError) as error:
        return [f"checkpoint.init_from={uri}: its config.json cannot be loaded into model.architecture=llama: {error}"]
    differences = model_differences(model, fields)
    if differences:
        fix = " ".join(f"--set {d.split(':', 1)[0]}={fields[d.split(':', 1)[0].removeprefix('model.')]}" for d in differences)
        return [
            f"checkpoint.init_from={uri} holds a model that differs from this run's in {len(differences)} field(s): "
            + "; ".join(differences) + f". Make the model section match: {fix}"
        ]
    return []


def read_hf_weights(filesystem: pafs.FileSystem, path: str, config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face directory's weights, converted to our Llama's names (model/hf.py)."""
    from safetensors.torch import load

    path = path.rstrip("/")

    def read(name: str) -> bytes:
        with filesystem.open_input_stream(f"{path}/{name}") as stream:
            return stream.read()

    names = ["model.safetensors"]
    if filesystem.get_file_info(f"{path}/{HF_INDEX}").type == pafs.FileType.File:
        names = sorted(set(json.loads(read(HF_INDEX))["weight_map"].values()))
    hf_state: dict[str, Any] = {}
    for name in names:
        try:
            hf_state.update(load(read(name)))
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint.init_from={path}: {name} is missing (only safetensors weights are read)") from None
    try:
        state = from_hf_llama(hf_state, config)
    except KeyError as error:
        raise CheckpointError(f"checkpoint.init_from={path}: the weights have no {error}") from None
    # A weight we would not read (a bias, another layer) means another model: refuse, never drop it.
    unread = sorted(set(hf_state) - set(to_hf_state_dict(state, config)) - {"lm_head.weight"})
    if unread:
        raise CheckpointError(f"checkpoint.init_from={path}: weights our llama has no place for: {unread[:5]}")
    return state
