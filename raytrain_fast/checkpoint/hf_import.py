"""`checkpoint.init_from` of a Hugging Face directory: the `config.json` of a Llama-family model
(Llama, Mistral, Qwen2, Qwen3) and its safetensors weights (one file, or shards with
`model.safetensors.index.json`), local or s3://.

Told apart from our own checkpoints by its config.json (ours hold config.yaml and manifests). The
driver reads config.json before any worker starts (`init_from_problems`): every field is mapped or
named as refused (model/hf.py), and a model that differs from the run's is refused with every differing
field in one message; data tokenized with another tokenizer than the directory's is refused where the
run's sources are checked (data/mixture.py's `init_from_tokenizer_problems`). On the
workers, rank 0 reads and converts the weights (`read_hf_weights`), then broadcasts them as for our
checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pyarrow.fs as pafs
import torch

from raytrain_fast.checkpoint.verify import read_file
from raytrain_fast.config.model import llama_option_problems
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
    try:
        data = json.loads(read_file(filesystem, target))
    except ValueError as error:
        raise CheckpointError(f"{target} is not valid JSON: {error}") from None
    return data if isinstance(data, dict) else None


def init_from_problems(config: Any) -> list[str]:
    """Why the Hugging Face model at run config `config`'s checkpoint.init_from cannot initialise its
    model ([] when it can, or when it is not a Hugging Face directory: our checkpoints are checked by
    the workers). Called on the driver before any worker starts."""
    from raytrain_fast.storage import resolve_filesystem

    uri, model = config.checkpoint.init_from, config.model
    filesystem, path = resolve_filesystem(uri, config.storage)
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
    # What the checkpoint's model cannot do here whatever the run's model says (a window under the sequence).
    problems = llama_option_problems(dataclasses.replace(model, **fields), seq_len=config.data.seq_len)
    if differences:
        fix = " ".join(f"--set {d.split(':', 1)[0]}={fields[d.split(':', 1)[0].removeprefix('model.')]}" for d in differences)
        problems.append(
            f"checkpoint.init_from={uri} holds a model that differs from this run's in {len(differences)} field(s): "
            + "; ".join(differences) + f". Make the model section match: {fix}"
        )
    return problems


def read_hf_weights(filesystem: pafs.FileSystem, path: str, config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face directory's weights, converted to our Llama's names (model/hf.py)."""
    from safetensors.torch import load

    path = path.rstrip("/")
    names = ["model.safetensors"]
    if filesystem.get_file_info(f"{path}/{HF_INDEX}").type == pafs.FileType.File:
        names = sorted(set(json.loads(read_file(filesystem, f"{path}/{HF_INDEX}"))["weight_map"].values()))
    hf_state: dict[str, Any] = {}
    for name in names:
        try:
            hf_state.update(load(read_file(filesystem, f"{path}/{name}")))
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint.init_from={path}: {name} is missing (only safetensors weights are read)") from None
    try:
        state = from_hf_llama(hf_state, config)
    except KeyError as error:
        raise CheckpointError(f"checkpoint.init_from={path}: the weights have no {error}") from None
    # A weight we would not read (a bias, another layer) means another model: refuse, never drop it.
    # A tied model's lm_head.weight, when written, must be the embedding it is tied to.
    unread = sorted(set(hf_state) - set(to_hf_state_dict(state, config)))
    if unread == ["lm_head.weight"] and torch.equal(hf_state["lm_head.weight"], state["token_emb.weight"]):
        unread = []
    if unread:
        raise CheckpointError(f"checkpoint.init_from={path}: weights our llama has no place for: {unread[:5]}")
    return state
