"""Write an exported model in the Hugging Face format (`raytrain-fast export --format hf`).

Files: config.json (model/hf.py), the weights as safetensors (one `model.safetensors`, or
`model-0000i-of-0000n.safetensors` shards with `model.safetensors.index.json` above
`max_shard_bytes`, as `save_pretrained` does), generation_config.json, and the tokenizer the run's
data was tokenized with (data/hf_tokenizer.py), found from the run config in the checkpoint: the
prepared data's manifest when data.source is a prepare-data output, else data.tokenizer. A
tokenizer file whose content changed since (its sha256 is not the manifest's) is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from raytrain_fast.errors import CheckpointError
from raytrain_fast.model import ModelConfig
from raytrain_fast.model.hf import hf_config, hf_refusal, to_hf_state_dict
from raytrain_fast.config.storage import StorageConfig

HF_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json")
"""Files whose presence in --out means an export is already there."""
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""transformers' save_pretrained default ("5GB")."""


def run_tokenizer(run_config: dict[str, Any], storage: StorageConfig | None, override: str | None = None):
    """The TokenizerSpec the run's data was tokenized with (or `override`, a tokenizer.json path)."""
    from raytrain_fast.data import load_manifest
    from raytrain_fast.data.tokenizer import load_tokenizer
    from raytrain_fast.errors import DataError

    data = run_config.get("data") or {}
    if override:
        return load_tokenizer(override, storage)
    source, asked = str(data.get("source", "stdlib")), str(data.get("tokenizer", "byte"))
    try:
        recorded = load_manifest(source, storage).tokenizer  # a prepare-data output: its manifest says
    except DataError:
        recorded = None  # raw text prepared on the fly with data.tokenizer
    try:
        spec = load_tokenizer(recorded.name if recorded else asked, storage)
    except DataError as error:
        raise CheckpointError(f"the run's tokenizer cannot be exported: {error}. Pass --tokenizer <tokenizer.json>") from None
    if recorded is not None and spec.info.hash != recorded.hash:
        raise CheckpointError(
            f"the tokenizer file {recorded.name} changed since the data was prepared (sha256 {spec.info.hash[:12]}, "
            f"the data manifest says {recorded.hash[:12]}): pass --tokenizer <the tokenizer.json the data was made with>"
        )
    return spec if recorded is None else dataclasses.replace(spec, info=recorded)  # the manifest says how the data was made


def write_hf_export(
    state: dict[str, torch.Tensor], config: ModelConfig, out_dir: str, *, tokenizer, dtype: str,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """Write the Hugging Face files for our `state` (in its final dtype) into out_dir; returns their names."""
    refusal = hf_refusal(config)
    if refusal:
        raise CheckpointError(f"cannot export in the Hugging Face format: {refusal}")
    os.makedirs(out_dir, exist_ok=True)
    for stale in [*Path(out_dir).glob("model*.safetensors"), Path(out_dir, "model.safetensors.index.json")]:
        stale.unlink(missing_ok=True)  # an --overwrite with another shard count must not leave old shards
    eod, bos = tokenizer.info.eod_id, tokenizer.info.bos_id
    written = _write_weights(to_hf_state_dict(state, config), out_dir, max_shard_bytes)
    files: dict[str, str] = {
        "config.json": json.dumps(hf_config(config, eos_token_id=eod, bos_token_id=bos, dtype=dtype), indent=2),
        "generation_config.json": json.dumps({"bos_token_id": bos, "eos_token_id": eod, "pad_token_id": eod}, indent=2),
    }
    from raytrain_fast.data.hf_tokenizer import hf_tokenizer_files

    files.update(hf_tokenizer_files(tokenizer, model_max_length=config.max_seq_len))
    for name, text in files.items():
        Path(out_dir, name).write_text(text + "\n")
    mode = Path(out_dir, "config.json").stat().st_mode & 0o777
    for name in written:  # safetensors creates its files 0600: give them the text files' (the umask's) mode
        os.chmod(Path(out_dir, name), mode)
    return written + list(files)


def _write_weights(tensors: dict[str, torch.Tensor], out_dir: str, max_shard_bytes: int) -> list[str]:
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    count = len(shards)
    names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" if count > 1 else "model.safetensors" for i in range(count)]
    for shard, name in zip(shards, names):
        save_file(shard, str(Path(out_dir, name)), metadata={"format": "pt"})  # transformers refuses files without it
    if count > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": {key: n for s, n in zip(shards, names) for key in s}}
        Path(out_dir, "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        names.append("model.safetensors.index.json")
    return names
