"""Mask credential-like values in a config before it is written anywhere (checkpoints, logs, metrics)."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"

# Single words that mark a credential. Matched against whole words of the key, so `max_tokens`,
# `tokens_per_sec` or `tokenizer` are NOT credentials but `session_token` and `hf_token` are.
_SECRET_WORDS = {"secret", "secrets", "password", "passwd", "passphrase", "token", "credential", "credentials",
                 "apikey", "accesskey", "secretkey", "privatekey", "authorization", "signature"}
# Word pairs that mark a credential: access_key, api_key, private_key, auth_key, ...
_SECRET_PAIRS = {("access", "key"), ("api", "key"), ("private", "key"), ("secret", "key"), ("auth", "key"),
                 ("client", "secret"), ("account", "key")}
_URL_WITH_USERINFO = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://)([^/\s:@]+):([^/\s@]+)@")


def _words(key: str) -> list[str]:
    # camelCase -> camel_Case, then split on anything that is not a letter or digit.
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", key)
    return [w for w in re.split(r"[^A-Za-z0-9]+", spaced.lower()) if w]


def is_secret_key(key: str) -> bool:
    """Whether a mapping key names a credential (secret_key, aws_session_token, apiKey, password, ...)."""
    words = _words(key)
    if any(w in _SECRET_WORDS for w in words):
        return True
    return any(pair in _SECRET_PAIRS for pair in zip(words, words[1:]))


def redact_string(text: str) -> str:
    """Mask the password of `scheme://user:password@host` and credential query parameters of URLs."""
    text = _URL_WITH_USERINFO.sub(lambda m: f"{m.group(1)}{m.group(2)}:{MASK}@", text)
    if "://" in text and "?" in text and " " not in text:
        try:
            parts = urlsplit(text)
            query = parse_qsl(parts.query, keep_blank_values=True)
        except ValueError:
            return text
        if any(is_secret_key(k) for k, _ in query):
            masked = [(k, MASK if is_secret_key(k) else v) for k, v in query]
            text = urlunsplit(parts._replace(query=urlencode(masked, safe="*")))
    return text


def _mask_all(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _mask_all(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_mask_all(v) for v in value)
    if value is None or value == "" or isinstance(value, (bool, int, float)):
        return value  # "not set" stays visible as not set; numbers and flags are not secrets
    return MASK


def redact(obj: Any) -> Any:
    """A copy of `obj` (dicts, lists, strings) with credential-like values replaced by "***".

    A value is masked when its key names a credential (see `is_secret_key`); unset values (None,
    "") stay as they are so a reader can tell "set" from "not set". Strings anywhere have URL
    passwords and credential query parameters masked. Other objects are returned unchanged.
    """
    if isinstance(obj, Mapping):
        return {k: (_mask_all(v) if isinstance(k, str) and is_secret_key(k) else redact(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v) for v in obj)
    if isinstance(obj, str):
        return redact_string(obj)
    return obj


_URL_TOKEN = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")
_SECRET_ENV_MIN_LEN = 6  # shorter values ("1", "true") would mask ordinary words


@functools.lru_cache(maxsize=8)
def _secret_names(names: frozenset[str]) -> tuple[str, ...]:
    return tuple(name for name in names if is_secret_key(name))


def _secret_env_values() -> list[str]:
    # Names are classified once per set of variables: this runs on every console write.
    names = _secret_names(frozenset(os.environ))
    values = {v for v in (os.environ.get(n, "") for n in names) if len(v) >= _SECRET_ENV_MIN_LEN}
    return sorted(values, key=len, reverse=True)  # longest first: a secret containing another


def redact_text(text: str) -> str:
    """Free text (messages, logs, printed YAML) with credentials masked: URL passwords, credential
    query parameters (presigned URLs), and the value of any secret-named environment variable
    (AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, ...) wherever it appears. The one redaction every
    printout of the command line goes through."""
    text = _URL_TOKEN.sub(lambda m: redact_string(m.group(0)), text)
    for secret in _secret_env_values():
        text = text.replace(secret, MASK)
    return text
