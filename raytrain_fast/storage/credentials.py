"""Where S3 credentials come from: the environment, a named profile, or the default AWS chain.

Resolved with botocore (a boto3 dependency) so that the order and the profile files are the ones
every AWS tool uses. Credentials are never read from or written to our own config files, and the
secret parts never appear in a repr, a log line or an error message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from raytrain_fast.config.storage import StorageConfig
from raytrain_fast.errors import StorageError

ENV_ACCESS_KEY = "AWS_ACCESS_KEY_ID"
ENV_SECRET_KEY = "AWS_SECRET_ACCESS_KEY"
ENV_SESSION_TOKEN = "AWS_SESSION_TOKEN"

# botocore methods whose keys do not expire: safe to hand to pyarrow as fixed values.
_STATIC_METHODS = {"env", "shared-credentials-file", "config-file", "explicit"}


@dataclass(frozen=True, kw_only=True)
class S3Credentials:
    access_key: str
    secret_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)
    source: str
    """Where they came from, in words, for messages."""
    refreshable: bool = False
    """Temporary credentials (instance/container role, web identity): pyarrow's own default chain
    fetches and refreshes them, so they are not passed to it as fixed values."""

    def secrets(self) -> list[str]:
        """Values that must never be printed."""
        return [s for s in (self.secret_key, self.session_token) if s]

    def masked_access_key(self) -> str:
        key = self.access_key
        return f"{key[:4]}...{key[-4:]}" if len(key) > 12 else "***"


def _botocore_session(profile: str | None):
    import botocore.session

    session = botocore.session.Session(profile=profile)
    # Bound the instance-metadata probe (off-cloud it must fail fast, not hang).
    session.set_config_variable("metadata_service_timeout", 1)
    session.set_config_variable("metadata_service_num_attempts", 1)
    return session


def _profile_files() -> str:
    credentials = os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")
    config = os.environ.get("AWS_CONFIG_FILE", "~/.aws/config")
    return f"{credentials} or {config}"


def resolve_credentials(storage: StorageConfig) -> S3Credentials | None:
    """The credentials to use for `storage`, or None when none are configured anywhere.

    Order: `storage.profile` if set (the environment variables are then ignored, as in the AWS
    CLI); else AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY; else botocore's default chain
    (AWS_PROFILE, shared files, container / instance role). Raises StorageError for a profile that
    does not exist and for half-set environment variables.
    """
    if storage.profile:
        import botocore.exceptions

        try:
            credentials = _botocore_session(storage.profile).get_credentials()
        except botocore.exceptions.ProfileNotFound:
            raise StorageError(
                f"AWS profile '{storage.profile}' (storage.profile) was not found in {_profile_files()}. "
                "Add it there, fix storage.profile, or set storage.profile=null and use "
                f"{ENV_ACCESS_KEY} / {ENV_SECRET_KEY}."
            ) from None
        if credentials is None:
            raise StorageError(
                f"AWS profile '{storage.profile}' (storage.profile) has no credentials in {_profile_files()}: "
                "add aws_access_key_id and aws_secret_access_key to it."
            )
        frozen = credentials.get_frozen_credentials()
        return S3Credentials(
            access_key=frozen.access_key, secret_key=frozen.secret_key, session_token=frozen.token,
            source=f"AWS profile '{storage.profile}'",
        )

    access_key, secret_key = os.environ.get(ENV_ACCESS_KEY), os.environ.get(ENV_SECRET_KEY)
    if access_key and secret_key:
        return S3Credentials(
            access_key=access_key, secret_key=secret_key, session_token=os.environ.get(ENV_SESSION_TOKEN) or None,
            source=f"environment variables {ENV_ACCESS_KEY} / {ENV_SECRET_KEY}",
        )
    if access_key or secret_key:
        present, missing = (ENV_ACCESS_KEY, ENV_SECRET_KEY) if access_key else (ENV_SECRET_KEY, ENV_ACCESS_KEY)
        raise StorageError(f"{present} is set but {missing} is not: set both (or neither, and use storage.profile).")

    credentials = _botocore_session(None).get_credentials()
    if credentials is None:
        return None
    frozen = credentials.get_frozen_credentials()
    method = getattr(credentials, "method", "unknown")
    return S3Credentials(
        access_key=frozen.access_key, secret_key=frozen.secret_key, session_token=frozen.token,
        source=f"the default AWS credential chain ({method})", refreshable=method not in _STATIC_METHODS,
    )


def missing_credentials_message(*, endpoint: str, bucket: str) -> str:
    return (
        f"No S3 credentials found for bucket '{bucket}' at {endpoint}. Set {ENV_ACCESS_KEY} and "
        f"{ENV_SECRET_KEY} in the environment (for `ray job submit`, also in the job's runtime_env "
        f"env_vars), or set storage.profile to a profile in {_profile_files()}."
    )
