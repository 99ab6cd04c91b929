"""The models `raytrain-fast evaluate` scores: a run's checkpoint (its consolidated weights in our model
class, its data's tokenizer) or a Hugging Face directory (through transformers, offline). A
`ModelSource` is picklable, so each worker of a multi-worker evaluation builds the same model from it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from raytrain_fast.config.model import ModelConfig
from raytrain_fast.config.storage import StorageConfig
from raytrain_fast.downstream.encode import Encoder
from raytrain_fast.downstream.tasks import TaskError
from raytrain_fast.errors import RaytrainFastError

EVAL_EXTRA = "pip install 'raytrain_fast[eval]'"
"""What installs transformers for `evaluate --hf`."""

Forward = Callable[[torch.Tensor], torch.Tensor]
"""(B, T) token ids -> (B, T, V) logits."""


@dataclass(kw_only=True)
class ModelSource:
    """What a worker needs to build the model: our weights and model config, or a Hugging Face directory."""

    description: str
    state: dict[str, torch.Tensor] | None = None
    config: ModelConfig | None = None
    hf_dir: str | None = None
    precision: str = "fp32"
    """bf16 or fp32: what the model's weights and activations are held in while scoring."""
    micro_batch: int | None = None
    """The micro-batch the run's own evaluations score with (eval.micro_batch, else train.micro_batch);
    None for a Hugging Face directory."""

    @property
    def packs(self) -> bool:
        """Whether the model takes a DocumentLayout (ours), so a shared context is read once for all choices."""
        return self.hf_dir is None

    def build(self, device: str) -> Forward:
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32
        if self.hf_dir is not None:
            model = _transformers().AutoModelForCausalLM.from_pretrained(self.hf_dir, local_files_only=True)
            model = model.to(device=device, dtype=dtype).eval()
            return lambda tokens: model(input_ids=tokens).logits
        from raytrain_fast.model import model_class

        assert self.state is not None and self.config is not None
        model = model_class(self.config)(self.config)
        model.load_state_dict(self.state, strict=True)
        # In bf16, every weight rounded from its fp32 master as DeepSpeed's bf16 engine holds it in training.
        return model.to(device=device, dtype=dtype).eval()  # model(tokens) -> logits


def _transformers() -> Any:
    """transformers, reading directories as they are (nothing fetched) with no progress bars: in
    every process that loads a model (each Ray worker of `--workers N` too)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        import transformers
    except ImportError:
        raise RaytrainFastError(
            f"evaluate --hf loads the model with transformers, which is not installed: {EVAL_EXTRA} "
            "(or pip install transformers)"
        ) from None
    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bar between our lines
    return transformers


def from_hf_dir(directory: str, *, precision: str | None = None) -> tuple[ModelSource, Encoder]:
    """A Hugging Face model directory (ours or another one): its model and tokenizer, read offline."""
    transformers = _transformers()
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise TaskError(
            f"--hf {directory}: no config.json there, so it is not a Hugging Face model directory (`raytrain-fast export "
            "--format hf` writes one; evaluate a run's checkpoint with --storage and --name instead)"
        )
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as error:
        raise TaskError(f"--hf {directory}: transformers cannot load its tokenizer or config offline: {error}") from None
    window = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not window:
        raise TaskError(f"--hf {directory}: its config.json names no maximum sequence length (max_position_embeddings)")
    eod = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id
    if eod is None:
        raise TaskError(f"--hf {directory}: its tokenizer has neither an eos nor a bos token to stand for an empty context")
    from raytrain_fast.data.tokenizer import added_bos

    def encode(text: str, special: bool = False) -> list[int]:
        return tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"]

    encoder = Encoder(
        encode=encode, eod_id=int(eod), vocab_size=int(config.vocab_size), window=int(window),
        unknown_id=tokenizer.unk_token_id, bos_id=added_bos(encode("a", True), encode("a")), name=directory,
    )
    source = ModelSource(description=f"Hugging Face model {directory}", hf_dir=os.path.abspath(directory), precision=precision or "fp32")
    return source, encoder


def from_checkpoint(
    *, storage_uri: str, storage: StorageConfig, name: str, step: int | None, tokenizer: str | None = None,
    precision: str | None = None,
) -> tuple[ModelSource, Encoder, int]:
    """Run `name`'s checkpoint at `step` (None: the newest complete one), downloaded and verified:
    (its model, its data's tokenizer for it, the step). The model scores at `precision`, by default
    the run's training precision, with the run's evaluation micro-batch: as the loop scored it."""
    from raytrain_fast.checkpoint.export import consolidated_state_dict, download_chosen, read_checkpoint_model_config, read_run_config
    from raytrain_fast.checkpoint.hf_export import run_tokenizer
    from raytrain_fast.downstream.run import encoder_for
    from raytrain_fast.storage.filesystem import resolve_filesystem

    filesystem, root = resolve_filesystem(storage_uri, storage)
    local_dir = tempfile.mkdtemp(prefix="raytrain-fast-evaluate-")
    try:
        path, _ = download_chosen(filesystem, f"{root.rstrip('/')}/{name}", local_dir, name=name, step=step, storage_uri=storage_uri)
        config = read_checkpoint_model_config(local_dir)
        if config is None:
            raise TaskError(f"the checkpoint {path} has no config.yaml with its model settings (saved by an older version)")
        run_config = read_run_config(local_dir)
        spec = run_tokenizer(run_config, storage, tokenizer)
        state, _ = consolidated_state_dict(local_dir)
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)
    checkpoint_step = int(path.rstrip("/").rsplit("_", 1)[-1])
    config = dataclasses.replace(config, activation_checkpointing="none", dropout=0.0)
    # An fp8 run keeps bf16 weights; its float8 matmuls need an FP8 GPU, so it scores in bf16 here.
    trained = _run_setting(run_config, "engine", "precision", ("bf16", "fp32", "fp8"))
    source = ModelSource(
        description=f"run '{name}' at step {checkpoint_step}", state=state, config=config,
        precision=precision or ("bf16" if trained == "fp8" else trained) or "fp32",
        micro_batch=_run_setting(run_config, "eval", "micro_batch", int) or _run_setting(run_config, "train", "micro_batch", int),
    )
    return source, encoder_for(spec, config), checkpoint_step


def _run_setting(run_config: dict[str, Any], section: str, key: str, allowed: Any) -> Any:
    """A value of the run's saved config when it is one of `allowed` (a tuple of values, or a type), else None."""
    value = (run_config.get(section) or {}).get(key)
    ok = value in allowed if isinstance(allowed, tuple) else isinstance(value, allowed) and not isinstance(value, bool)
    return value if ok else None
