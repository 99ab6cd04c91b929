"""The validation split asked of `prepare_data`: a hashed share of the inputs' documents, or separate
inputs; its writers and its entry in the manifest."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.fs as pafs

from raytrain_fast.data.inputs import Listing, canonical_input, list_sources
from raytrain_fast.data.manifest import Skipped, ValidationSplit, join_uri
from raytrain_fast.data.shards import VAL_DIR, ShardWriter, ValPacker
from raytrain_fast.errors import DataError
from raytrain_fast.console import say

DEFAULT_VAL_FRACTION = 0.005
VAL_MAX_TOKENS = 1 << 23
"""Cap of the hashed validation split (~8M tokens): evaluation reads a fixed subset of it anyway
(eval.sequences), so a larger split would only take documents from training."""


@dataclass(kw_only=True)
class SplitRequest:
    """What was asked of the validation split: a hashed share of the inputs, or separate inputs."""

    fraction: float
    explicit: bool
    """Asked for on the command line (an empty split is then an error, not a warning)."""
    inputs: list[str]
    """Canonical --val-input items (empty: a hashed split)."""
    names: tuple[str, str] = ("--val-fraction", "--val-input")
    """How the caller spells the two settings in messages: prepare-data's flags, or pretrain's data.* keys."""

    @classmethod
    def of(cls, val_fraction: float | None, val_inputs: list[str] | None,
           names: tuple[str, str] = ("--val-fraction", "--val-input")) -> SplitRequest:
        if val_fraction is not None and val_inputs:
            raise DataError(f"pass either {names[0]} (a share of the input) or {names[1]} (a separate corpus), not both")
        if val_fraction is not None and not 0.0 < val_fraction <= 0.5:
            raise DataError(
                f"{names[0]} must be in (0, 0.5], got {val_fraction}: it is the share of documents held out "
                f"for validation (default {DEFAULT_VAL_FRACTION})"
            )
        inputs = [canonical_input(item) for item in val_inputs or []]
        fraction = 1.0 if inputs else (val_fraction if val_fraction is not None else DEFAULT_VAL_FRACTION)
        return cls(fraction=fraction, explicit=val_fraction is not None or bool(inputs), inputs=inputs, names=names)

    def recipe(self) -> dict[str, Any]:
        return {"val_inputs": self.inputs} if self.inputs else {"val_fraction": self.fraction}

    def listing(self, train: Listing, filesystems: dict[str, pafs.FileSystem], exclude: str | None) -> Listing:
        """The training listing with every source's share set, plus the --val-input files."""
        for source in train.sources:
            source.val_fraction = 0.0 if self.inputs else self.fraction
        if not self.inputs:
            return train
        held = list_sources(self.inputs, s3=filesystems.get("s3"), exclude=exclude)
        training = {s.uri for s in train.sources}
        both = [s.uri for s in held.sources if s.uri in training]
        if both:
            raise DataError(f"{len(both)} file(s) are both --input and --val-input (e.g. {both[0]}); a document must be in one split only")
        for source in held.sources:
            source.val_fraction = 1.0
        held.skipped = [Skipped(path=s.path, reason=f"--val-input: {s.reason}") for s in held.skipped]
        return Listing(sources=train.sources + held.sources, skipped=train.skipped + held.skipped)

    def writers(
        self, filesystem: pafs.FileSystem, root: str, *, seq_len: int, rows_per_shard: int, dtype: np.dtype
    ) -> tuple[ShardWriter, ValPacker]:
        """The training shards' writer and the validation split's packer (its shards under val/)."""
        filesystem.create_dir(join_uri(root, VAL_DIR), recursive=True)
        writer = ShardWriter(filesystem=filesystem, root=root, seq_len=seq_len, rows_per_shard=rows_per_shard, dtype=dtype)
        held = ShardWriter(filesystem=filesystem, root=root, seq_len=seq_len, rows_per_shard=rows_per_shard, dtype=dtype, prefix=f"{VAL_DIR}/")
        return writer, ValPacker(held, writer, max_tokens=0 if self.inputs else VAL_MAX_TOKENS)

    def result(self, val: ValPacker, *, verbose: bool) -> ValidationSplit | None:
        """The split for the manifest; None (with a warning) when the default share chose nothing."""
        if not val.writer.num_rows:
            fraction, separate = self.names
            fix = (
                f"add documents to {separate}" if self.inputs else
                f"raise {fraction} (now {self.fraction}; a corpus of few large files holds few documents) or set {separate}"
            )
            message = f"the validation split came out empty ({val.writer.tokens_added:,} tokens, fewer than one sequence); {fix}"
            if self.explicit:
                raise DataError(message)
            if verbose:
                who = "prepare-data: warning" if fraction.startswith("--") else "Data: warning"
                say(f"{who}: {message}. Prepared without one: evaluation will be off.", stderr=True)
            return None
        return ValidationSplit(
            method="inputs" if self.inputs else "hash", fraction=self.fraction, max_tokens=val.max_tokens,
            num_sequences=val.writer.num_rows, num_documents=val.num_documents, num_dropped_tokens=val.dropped,
            shards=val.writer.shards, sources=val.sources,
        )
