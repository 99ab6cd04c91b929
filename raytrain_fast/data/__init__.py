"""Corpora, tokenization, packing and the Ray Data ingest path."""

from raytrain_fast.data.config import DataConfig
from raytrain_fast.data.corpus import BYTE_VOCAB_SIZE, EOD_TOKEN, corpus_files, pack_sequences, tokenize_files
from raytrain_fast.data.dataset import batches, build_dataset

__all__ = [
    "BYTE_VOCAB_SIZE", "DataConfig", "EOD_TOKEN", "batches", "build_dataset", "corpus_files",
    "pack_sequences", "tokenize_files",
]
