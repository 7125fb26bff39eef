"""The fixtures start real servers that answer, and can be restarted."""

from __future__ import annotations

import boto3
import redis

from tests.fixtures.servers import RedisServer, SeaweedS3Server


def test_redis_answers_and_restarts(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.set("k", "v")
    assert client.get("k") == b"v"
    redis_server.stop()
    redis_server.start()
    assert redis.Redis.from_url(redis_server.url).ping()


def test_s3_round_trip_with_ranged_get(s3_server: SeaweedS3Server, s3_bucket: str) -> None:
    s3 = boto3.client("s3", endpoint_url=s3_server.endpoint_url)
    s3.create_bucket(Bucket=s3_bucket)
    s3.put_object(Bucket=s3_bucket, Key="a/b", Body=b"hello world")
    ranged = s3.get_object(Bucket=s3_bucket, Key="a/b", Range="bytes=6-10")["Body"].read()
    assert ranged == b"world"
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert keys == ["a/b"]


def test_tiny_models_saved_as_hf_folders(tiny_model_dirs) -> None:
    for folder in tiny_model_dirs.values():
        assert (folder / "config.json").exists()
        assert (folder / "model.safetensors").exists()
