"""check_storage against a real S3 server on loopback: bad settings fail fast, with the fix named and
the secret never shown."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from raytrain_fast.storage import StorageConfig, StorageError, check_storage, redact
from tests.s3_server import ACCESS_KEY, S3Server, SECRET_KEY, free_port

pytestmark = pytest.mark.unit

FAST_S = 5.0  # "fails in seconds"


def _bucket_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"



def _objects(server, bucket: str) -> dict[str, bytes]:
    """Every object except empty directory markers ("runs/"), which pyarrow leaves after a delete."""
    client = server.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", []) if not o["Key"].endswith("/")]
    return {k: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def _check_fails(storage: StorageConfig, **kwargs) -> str:
    start = time.monotonic()
    with pytest.raises(StorageError) as error:
        check_storage(storage, **kwargs)
    assert time.monotonic() - start < FAST_S
    message = str(error.value)
    assert SECRET_KEY not in message
    return message


def test_good_bucket_passes_and_leaves_nothing_behind(aws_env):
    bucket = aws_env.make_bucket(_bucket_name("ok"))
    check_storage(StorageConfig(uri=f"s3://{bucket}/runs", endpoint_url=aws_env.endpoint_url))
    assert _objects(aws_env, bucket) == {}  # the marker object was deleted


def test_wrong_endpoint_port_fails_fast_naming_endpoint_and_bucket(aws_env):
    bucket = aws_env.make_bucket(_bucket_name("port"))
    wrong = f"http://127.0.0.1:{free_port()}"
    message = _check_fails(StorageConfig(uri=f"s3://{bucket}/runs", endpoint_url=wrong))
    assert "Cannot reach" in message and wrong in message and bucket in message
    assert "storage.endpoint_url" in message


def test_missing_bucket_suggests_create_bucket_and_create_bucket_creates_it(aws_env):
    bucket = _bucket_name("missing")
    storage = StorageConfig(uri=f"s3://{bucket}/runs/x", endpoint_url=aws_env.endpoint_url)
    message = _check_fails(storage)
    assert f"Bucket '{bucket}' does not exist" in message and aws_env.endpoint_url in message
    assert "--create-bucket" in message

    check_storage(storage, create_bucket=True)
    names = [b["Name"] for b in aws_env.client().list_buckets()["Buckets"]]
    assert bucket in names
    assert _objects(aws_env, bucket) == {}
    check_storage(storage)  # now it exists: passes without the flag


def test_missing_credentials_name_the_env_vars_and_profile(aws_env, monkeypatch):
    bucket = aws_env.make_bucket(_bucket_name("nocreds"))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    message = _check_fails(StorageConfig(uri=f"s3://{bucket}/runs", endpoint_url=aws_env.endpoint_url))
    assert "No S3 credentials" in message and bucket in message and aws_env.endpoint_url in message
    assert "AWS_ACCESS_KEY_ID" in message and "AWS_SECRET_ACCESS_KEY" in message and "storage.profile" in message


def test_half_set_credentials_name_the_missing_variable(aws_env, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    message = _check_fails(StorageConfig(uri="s3://whatever/runs", endpoint_url=aws_env.endpoint_url))
    assert "AWS_SECRET_ACCESS_KEY is set but AWS_ACCESS_KEY_ID is not" in message


def test_named_profile_supplies_credentials(aws_env, monkeypatch, tmp_path):
    bucket = aws_env.make_bucket(_bucket_name("profile"))
    credentials_file = tmp_path / "credentials"
    credentials_file.write_text(f"[rtf-test]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials_file))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    check_storage(StorageConfig(uri=f"s3://{bucket}/runs", endpoint_url=aws_env.endpoint_url, profile="rtf-test"))

    message = _check_fails(StorageConfig(uri=f"s3://{bucket}/runs", endpoint_url=aws_env.endpoint_url, profile="nope"))
    assert "AWS profile 'nope'" in message and str(credentials_file) in message


def test_access_denied_and_rejected_keys_on_a_server_that_checks_them(monkeypatch, tmp_path):
    """A second server with IAM enforcement on: a read-only user, and an unknown secret."""
    import boto3

    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "4")  # setup calls below, then auth is enforced
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    server = S3Server().start()
    try:
        admin = {"endpoint_url": server.endpoint_url, "aws_access_key_id": ACCESS_KEY,
                 "aws_secret_access_key": SECRET_KEY, "region_name": "us-east-1"}
        iam = boto3.client("iam", **admin)
        iam.create_user(UserName="reader")
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        iam.put_user_policy(UserName="reader", PolicyName="read", PolicyDocument=json.dumps({
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": "*"}],
        }))
        boto3.client("s3", **admin).create_bucket(Bucket="guarded")
        storage = StorageConfig(uri="s3://guarded/runs", endpoint_url=server.endpoint_url)

        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        message = _check_fails(storage)
        assert message.startswith("Access denied") and "guarded" in message and "s3:PutObject" in message
        assert key["SecretAccessKey"] not in message and key["AccessKeyId"] not in message  # masked

        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)  # real key id, wrong secret
        message = _check_fails(storage)
        assert "rejected the credentials" in message and "AWS_SECRET_ACCESS_KEY" in message
    finally:
        server.stop()


def test_local_path_is_created_and_unwritable_path_fails(tmp_path):
    target = tmp_path / "a" / "runs"
    check_storage(StorageConfig(uri=str(target)))
    assert target.is_dir() and list(target.iterdir()) == []

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError, match="not writable.*storage.uri"):
        check_storage(StorageConfig(uri=str(blocker / "runs")))


def test_redacted_config_file_never_holds_the_secret(tmp_path):
    from raytrain_fast.config import Config

    config = Config().to_dict()
    config["storage"]["endpoint_url"] = f"http://admin:{SECRET_KEY}@127.0.0.1:9000"
    config["wandb"] = {"api_key": SECRET_KEY, "project": "p", "entity": None}
    config["extra"] = {"aws_secret_access_key": SECRET_KEY, "sessionToken": SECRET_KEY, "max_tokens": 7}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(redact(config)))

    text = path.read_text()
    assert SECRET_KEY not in text
    written = json.loads(text)
    assert written["extra"] == {"aws_secret_access_key": "***", "sessionToken": "***", "max_tokens": 7}
    assert written["wandb"] == {"api_key": "***", "project": "p", "entity": None}
    assert written["storage"]["endpoint_url"] == "http://admin:***@127.0.0.1:9000"
    assert written["model"] == config["model"] and written["data"] == config["data"]  # tokens etc. untouched
