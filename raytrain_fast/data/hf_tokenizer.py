"""The tokenizer of a run as Hugging Face files: tokenizer.json, tokenizer_config.json and
special_tokens_map.json, which `AutoTokenizer.from_pretrained(dir)` loads with no code of ours.

Written as plain JSON, without the `tokenizers` package (an optional extra). The byte tokenizer
becomes a real `tokenizers` file with the same ids: a ByteLevel pre-tokenizer
(no regex split, no prefix space) maps every UTF-8 byte to one printable character, a 256-entry
vocabulary gives character <byte b> the id b, no merges, and the end-of-document token
`<|endoftext|>` is the special token 256. So `tokenizer.encode(text)` is list(text.encode()), as
in `data/tokenizer.py`, and `prepare-data --tokenizer <that tokenizer.json>` makes the same tokens
as `byte` (EOD_CANDIDATES finds `<|endoftext|>`).
"""

from __future__ import annotations

import json

from raytrain_fast.data.corpus import EOD_TOKEN
from raytrain_fast.data.tokenizer import TokenizerSpec
from raytrain_fast.errors import DataError

BYTE_EOD_TEXT = "<|endoftext|>"
"""The byte tokenizer's end-of-document token (id 256) in its exported tokenizer.json."""


def _byte_level_characters() -> dict[int, str]:
    """The ByteLevel pre-tokenizer's byte -> character table (GPT-2's bytes_to_unicode): printable
    bytes stand for themselves, the others for characters from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


def byte_tokenizer_json() -> str:
    """tokenizer.json of the byte tokenizer (see the module's docstring), written as the `tokenizers`
    library writes it, without the library: an export needs no optional package."""
    eod = {"id": EOD_TOKEN, "content": BYTE_EOD_TEXT, "single_word": False, "lstrip": False, "rstrip": False,
           "normalized": False, "special": True}
    model = {
        "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
        "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
        "vocab": {char: b for b, char in _byte_level_characters().items()}, "merges": [],
    }
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [eod], "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": model,
    }, ensure_ascii=False)


def token_text(json_text: str, token_id: int) -> str | None:
    """The text of token `token_id` in a tokenizers JSON file (its added tokens first, then its
    model's vocabulary), read as JSON: no `tokenizers` import."""
    data = json.loads(json_text)
    for added in data.get("added_tokens") or []:
        if added.get("id") == token_id:
            return added.get("content")
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: {token: id}
        return next((token for token, i in vocab.items() if i == token_id), None)
    if isinstance(vocab, list) and 0 <= token_id < len(vocab):  # Unigram: [[piece, score], ...] by id
        return vocab[token_id][0]
    return None


def hf_tokenizer_files(spec: TokenizerSpec, *, model_max_length: int | None) -> dict[str, str]:
    """{file name: text} for the tokenizer `spec` (the byte tokenizer or a tokenizers JSON file), so
    that `AutoTokenizer(text)` gives the ids the data was made with (its end-of-document token as
    eos_token; its beginning-of-text token before a text when the data has one before each document,
    else no post-processor) and pads a batch (the same token as pad_token: the attention mask keeps
    the model off it). model_max_length None: left out (a tokenizer of no model yet). Plain JSON: no
    `tokenizers` import."""
    json_text = spec.json_text if spec.json_text is not None else byte_tokenizer_json()
    data = json.loads(json_text)
    # The post-processor stays only where it put the BOS that the data has before each document
    # (TokenizerInfo.bos_id); any other would add tokens the model never saw in that place.
    if data.get("post_processor") is not None and spec.info.bos_id is None:
        data["post_processor"] = None
        json_text = json.dumps(data, ensure_ascii=False)
    eod = token_text(json_text, spec.info.eod_id)
    if eod is None:
        raise DataError(f"tokenizer {spec.info.name} has no token with the end-of-document id {spec.info.eod_id}")
    special = {"eos_token": eod, "pad_token": eod}
    if spec.info.bos_id is not None:
        special["bos_token"] = token_text(json_text, spec.info.bos_id)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **({"model_max_length": model_max_length} if model_max_length is not None else {}),
        "clean_up_tokenization_spaces": False, "add_bos_token": spec.info.bos_id is not None, "add_eos_token": False,
        **special,
    }
    return {
        "tokenizer.json": json_text,
        "tokenizer_config.json": json.dumps(config, indent=2),
        "special_tokens_map.json": json.dumps(special, indent=2),
    }
