import pytest

pytestmark = pytest.mark.unit


def test_loopback_s3_server_round_trip(s3_server):
    bucket = s3_server.make_bucket("roundtrip")
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="a/b.txt", Body=b"hello")
    assert client.get_object(Bucket=bucket, Key="a/b.txt")["Body"].read() == b"hello"
    assert s3_server.endpoint_url.startswith("http://127.0.0.1:")
