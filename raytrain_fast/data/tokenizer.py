"""Tokenizers for `prepare_data`: the built-in byte tokenizer, or a HuggingFace `tokenizers` JSON file.

Both turn a list of documents (UTF-8 bytes) into one id array with the end-of-document id after each
document, and, for a tokenizer file whose post-processor puts a beginning-of-text token before a text
(Llama 3, Mistral), that token before each document, as the family trained. A tokenizer travels to
Ray tasks as its JSON text (never as a path: the file may only exist on the driver) and is rebuilt
once per process.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pyarrow.fs as pafs

from raytrain_fast.data.corpus import BYTE_VOCAB_SIZE, EOD_TOKEN
from raytrain_fast.data.manifest import TokenizerInfo
from raytrain_fast.errors import DataError
from raytrain_fast.storage import StorageConfig, resolve_filesystem

BYTE_TOKENIZER = "byte"
TOKENIZER_FILE = "tokenizer.json"
"""The file of a Hugging Face tokenizer directory that `load_tokenizer` reads."""
_BYTE_DESCRIPTION = b"raytrain_fast byte tokenizer v1: ids 0-255 are bytes, 256 ends a document"
# Looked up in this order in a tokenizer file; the first one present ends every document.
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "<|end_of_text|>", "[EOS]", "<|im_end|>")


@dataclass(frozen=True, kw_only=True)
class TokenizerSpec:
    """Everything a worker process needs to rebuild the tokenizer (picklable, no paths)."""

    info: TokenizerInfo
    json_text: str | None = None
    """The tokenizer file's content; None for the byte tokenizer."""

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint16 if self.info.vocab_size <= 1 << 16 else np.uint32)

    def encode_documents(self, documents: list[bytes]) -> np.ndarray:
        """Ids of every document, each followed by the EOD id, as one array of `dtype`."""
        if not documents:
            return np.zeros(0, dtype=self.dtype)
        if self.json_text is None:
            return _encode_bytes(documents)
        tokenizer = _hf_tokenizer(self.info.hash, self.json_text)
        texts = [doc.decode("utf-8") for doc in documents]
        encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
        eod = np.array([self.info.eod_id], dtype=self.dtype)
        bos = [np.array([self.info.bos_id], dtype=self.dtype)] if self.info.bos_id is not None else []
        parts: list[np.ndarray] = []
        for encoding in encodings:
            parts += [*bos, np.asarray(encoding.ids, dtype=self.dtype), eod]
        return np.concatenate(parts)

    def encode_text(self, text: str) -> list[int]:
        """Ids of one text as it would appear inside a document (no end-of-document id, no special tokens)."""
        if self.json_text is None:
            return list(text.encode("utf-8"))
        return _hf_tokenizer(self.info.hash, self.json_text).encode(text, add_special_tokens=False).ids

    @property
    def unknown_id(self) -> int | None:
        """The id a tokenizer gives text it has no token for (None: every text has tokens, as for byte-level ones)."""
        if self.json_text is None:
            return None
        tokenizer = _hf_tokenizer(self.info.hash, self.json_text)
        unknown = getattr(tokenizer.model, "unk_token", None)
        return tokenizer.token_to_id(unknown) if unknown else None


def _encode_bytes(documents: list[bytes]) -> np.ndarray:
    out = np.frombuffer(b"\0".join([*documents, b""]), dtype=np.uint8).astype(np.uint16)
    out[np.cumsum([len(doc) + 1 for doc in documents]) - 1] = EOD_TOKEN  # each document's \0 becomes EOD
    return out


def byte_tokenizer() -> TokenizerSpec:
    info = TokenizerInfo(
        kind="byte", name=BYTE_TOKENIZER, hash=hashlib.sha256(_BYTE_DESCRIPTION).hexdigest(),
        vocab_size=BYTE_VOCAB_SIZE, eod_id=EOD_TOKEN,
    )
    return TokenizerSpec(info=info)


def load_tokenizer(tokenizer: str, storage: StorageConfig | None = None) -> TokenizerSpec:
    """`byte`, or the path / s3:// URI of a HuggingFace `tokenizers` JSON file (tokenizer.json) or of a
    directory holding one (a Hugging Face model or tokenizer directory, e.g. `train-tokenizer`'s output)."""
    if tokenizer == BYTE_TOKENIZER:
        return byte_tokenizer()
    filesystem, path = resolve_filesystem(tokenizer, storage or StorageConfig())
    directory = _is_directory(filesystem, path)
    if directory:
        path = f"{path.rstrip('/')}/{TOKENIZER_FILE}"
    try:
        with filesystem.open_input_stream(path) as stream:
            raw = stream.read()
    except (FileNotFoundError, OSError) as error:
        if directory:
            raise DataError(
                f"tokenizer '{tokenizer}' is a directory without a {TOKENIZER_FILE}; give a Hugging Face model or "
                f"tokenizer directory that holds one (e.g. the output of raytrain-fast train-tokenizer), a "
                f"{TOKENIZER_FILE} path, or 'byte'"
            ) from None
        raise DataError(
            f"tokenizer '{tokenizer}' cannot be read ({error}); give 'byte', the path of a "
            "HuggingFace tokenizers JSON file (tokenizer.json) or a directory holding one"
        ) from None
    try:
        json_text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"tokenizer '{tokenizer}' is not a JSON text file") from None
    digest = hashlib.sha256(raw).hexdigest()
    hf = _hf_tokenizer(digest, json_text, source=tokenizer)
    eod_id = next((hf.token_to_id(token) for token in EOD_CANDIDATES if hf.token_to_id(token) is not None), None)
    if eod_id is None and directory:  # a model directory may name its own: its tokenizer_config.json's eos_token
        eos = _configured_eos(filesystem, path.rsplit("/", 1)[0])
        eod_id = hf.token_to_id(eos) if eos else None
    if eod_id is None:
        raise DataError(
            f"tokenizer '{tokenizer}' has no end-of-document token (looked for {', '.join(EOD_CANDIDATES)}); "
            "add one as a special token, e.g. tokenizer.add_special_tokens(['<|endoftext|>'])"
        )
    # Recorded in manifests and read back by `export`, maybe from another directory: a local path absolute.
    name = tokenizer if "://" in tokenizer else os.path.abspath(os.path.expanduser(tokenizer))
    bos_id = added_bos(hf.encode("a", add_special_tokens=True).ids, hf.encode("a", add_special_tokens=False).ids)
    info = TokenizerInfo(kind="hf", name=name, hash=digest, vocab_size=hf.get_vocab_size(with_added_tokens=True), eod_id=eod_id,
                         bos_id=bos_id)
    return TokenizerSpec(info=info, json_text=json_text)


def added_bos(with_special: list[int], plain: list[int]) -> int | None:
    """The beginning-of-text id a tokenizer adds before a text (from a text's ids with and without its
    special tokens), or None unless it adds exactly one id, before the text."""
    return with_special[0] if len(with_special) == len(plain) + 1 and with_special[1:] == plain else None


def _is_directory(filesystem, path: str) -> bool:
    try:
        return filesystem.get_file_info(path).type == pafs.FileType.Directory
    except OSError:  # unreachable or refused: reading it below says so
        return False


def _configured_eos(filesystem, directory: str) -> str | None:
    """The eos_token of `directory`'s tokenizer_config.json (a string or an AddedToken dict), if any."""
    try:
        with filesystem.open_input_stream(f"{directory}/tokenizer_config.json") as stream:
            eos = json.loads(stream.read()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


@lru_cache(maxsize=4)
def _hf_tokenizer(digest: str, json_text: str, *, source: str = "tokenizer"):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError(
            f"tokenizer '{source}' is a HuggingFace tokenizers file, but the 'tokenizers' package is not "
            "installed: pip install tokenizers (or use tokenizer 'byte')"
        ) from None
    try:
        return Tokenizer.from_str(json_text)
    except Exception as error:  # the Rust side raises a plain Exception for malformed files
        raise DataError(f"tokenizer '{source}' is not a valid tokenizers JSON file: {error}") from None
