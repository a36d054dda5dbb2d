"""The KV store's URL: AUTH (a real redis-server with requirepass) and TLS (rediss://: the bundled redis-server is
built without TLS, so the client's configuration is what is checked), through the worker's store_client, which
takes the URL forms the kvmanager's state Redis takes."""

from __future__ import annotations

import pytest
import redis

from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.common.wire.tier import store_key
from kvserve.worker.tier import store_client


@pytest.fixture(scope="module")
def locked_store(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("store"), args=("--requirepass", "s3cret")) as server:
        yield server


def test_a_store_with_auth_is_reached_with_its_password_and_refused_without(locked_store):
    url = f"redis://:s3cret@127.0.0.1:{locked_store.port}/0"
    client = store_client(url)
    client.set(store_key(b"h" * 16), b"value")
    assert client.get(store_key(b"h" * 16)) == b"value"
    for bad in (f"redis://127.0.0.1:{locked_store.port}/0", f"redis://:wrong@127.0.0.1:{locked_store.port}/0"):
        with pytest.raises(redis.AuthenticationError):
            store_client(bad).get(store_key(b"h" * 16))


def test_a_rediss_url_makes_tls_connections_with_the_given_ca(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("not read until a connection is made")
    client = store_client(f"rediss://:pw@store.example:6380/0?ssl_ca_certs={ca}&ssl_cert_reqs=required")
    pool = client.connection_pool
    assert issubclass(pool.connection_class, redis.SSLConnection)
    kwargs = pool.connection_kwargs
    assert (kwargs["host"], kwargs["port"], kwargs["password"]) == ("store.example", 6380, "pw")
    assert kwargs["ssl_ca_certs"] == str(ca) and kwargs["ssl_cert_reqs"] == "required"
