"""Corpora, tokenization, packing (`prepare`) and the Ray Data ingest path (`ingest`).

Names are imported on first use, so `prepare-data` never pays for importing torch.
"""

from __future__ import annotations

from raytrain_fast._lazy import lazy_exports

_EXPORTS = {
    "DataConfig": "raytrain_fast.config.data",
    "BYTE_VOCAB_SIZE": "raytrain_fast.data.corpus",
    "EOD_TOKEN": "raytrain_fast.data.corpus",
    "stdlib_files": "raytrain_fast.data.corpus",
    "Manifest": "raytrain_fast.data.manifest",
    "prepare_data": "raytrain_fast.data.prepare",
    "ensure_prepared_corpus": "raytrain_fast.data.cache",
    "BatchIterator": "raytrain_fast.data.ingest",
    "check_manifest_matches": "raytrain_fast.data.manifest",
    "load_manifest": "raytrain_fast.data.manifest",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)
