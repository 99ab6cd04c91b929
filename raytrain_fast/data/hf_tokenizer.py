"""The tokenizer of a run as Hugging Face files: tokenizer.json, tokenizer_config.json and
special_tokens_map.json, which `AutoTokenizer.from_pretrained(dir)` loads with no code of ours.

The byte tokenizer becomes a real `tokenizers` file with the same ids: a ByteLevel pre-tokenizer
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

BYTE_EOD_TEXT = "<|endoftext|>"
"""The byte tokenizer's end-of-document token (id 256) in its exported tokenizer.json."""


def byte_tokenizer_json() -> str:
    """tokenizer.json of the byte tokenizer (ids 0-255 = bytes, 256 = `<|endoftext|>`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # 256 printable stand-ins, one per byte
    # ByteLevel's byte -> character table (GPT-2's bytes_to_unicode), to give each byte its own id.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    table = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    assert set(table.values()) == set(alphabet)
    tokenizer = Tokenizer(models.BPE(vocab={char: b for b, char in table.items()}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BYTE_EOD_TEXT])
    assert tokenizer.token_to_id(BYTE_EOD_TEXT) == EOD_TOKEN
    return tokenizer.to_str()


def hf_tokenizer_files(spec: TokenizerSpec, *, model_max_length: int | None) -> dict[str, str]:
    """{file name: text} for the tokenizer `spec` (the byte tokenizer or a tokenizers JSON file), so
    that `AutoTokenizer(text)` gives the ids the data was made with (its end-of-document token as
    eos_token, no post-processor). model_max_length None: left out (a tokenizer of no model yet)."""
    from tokenizers import Tokenizer

    json_text = spec.json_text if spec.json_text is not None else byte_tokenizer_json()
    data = json.loads(json_text)
    # prepare-data encodes with add_special_tokens=False: no post-processor ran on the training
    # tokens, so none may run on the exported tokenizer's either (a BOS the model never saw).
    if data.get("post_processor") is not None:
        data["post_processor"] = None
        json_text = json.dumps(data, ensure_ascii=False)
    eod = Tokenizer.from_str(json_text).id_to_token(spec.info.eod_id)
    special = {"eos_token": eod}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False, **special,
    }
    if model_max_length is None:
        del config["model_max_length"]
    return {
        "tokenizer.json": json_text,
        "tokenizer_config.json": json.dumps(config, indent=2),
        "special_tokens_map.json": json.dumps(special, indent=2),
    }
