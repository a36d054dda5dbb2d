"""TLS with real certificates (made here with ``cryptography``): a client without the CA is refused, one with it
gets in; with mutual TLS a client without a certificate, or with one another CA signed, is refused; the whole
stack (kvmanager, a worker that joins it, the gateway) as real processes under mutual TLS, driven by the SDK,
the CLI and the official ``openai`` client over HTTPS; the plaintext warning; bad TLS flags."""

from __future__ import annotations

import contextlib
import logging
import re
import ssl
from dataclasses import replace

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_process import EXIT_TIMEOUT_S, service_process
from test_cli_process import cli_env, run_cli
from tls_certs import make_ca

from kvserve.common.channels import kvmanager_channel
from kvserve.common.tls import Tls, TlsError, load_tls, open_channel, warn_if_plaintext
from kvserve.kvmanager.server import start_kvmanager_server
from kvserve.kvmanager.service import KVService
from kvserve.services.client import Client, Unavailable, tls_credentials
from kvserve.services.gateway.errors import KVManagerFailed
from kvserve.services.gateway.http.server import HttpServer
from kvserve.services.gateway.rpc.clients import KVManagerClient
from kvserve.v1 import kvmanager_pb2, kvmanager_pb2_grpc

ADMIN_TOKEN = "tls-test-token"
READY_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA, a server certificate (127.0.0.1, localhost) and a client certificate it signed, and a client
    certificate another CA signed."""
    folder = tmp_path_factory.mktemp("certs")
    ca, other = make_ca(folder, "ca"), make_ca(folder, "other-ca")
    return {"ca": ca, "server": ca.issue(folder, "server", server=True),
            "client": ca.issue(folder, "client", server=False),
            "stranger": other.issue(folder, "stranger", server=False), "folder": folder}


def server_tls(certs, mutual: bool) -> Tls:
    return load_tls(certs["server"].cert, certs["server"].key, certs["ca"].cert if mutual else None, server=True)


def client_tls(certs, who: str | None = None, with_ca: bool = True) -> Tls | None:
    issued = certs[who] if who else None
    return load_tls(issued.cert if issued else None, issued.key if issued else None,
                    certs["ca"].cert if with_ca else None, server=False)


@contextlib.contextmanager
def kvmanager(tls: Tls | None, leading: bool = True):
    """A real kvmanager server on a free port: the leader, or a standby (NOT_SERVING, calls UNAVAILABLE)."""
    service = KVService()
    service.leading = leading
    server = start_kvmanager_server(service, "127.0.0.1", 0, admin_token=ADMIN_TOKEN, tls=tls)
    try:
        yield server
    finally:
        server.stop(0)


def health(target: str, tls: Tls | None, credentials: grpc.ChannelCredentials | None = None) -> int:
    """The server's overall health status over a channel with ``tls`` (or raw ``credentials``)."""
    channel = (grpc.secure_channel(target, credentials) if credentials is not None else open_channel(target, tls))
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def refused(target: str, tls: Tls | None, credentials: grpc.ChannelCredentials | None = None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        health(target, tls, credentials)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    return err.value


# -- TLS, then mutual TLS, on a real kvmanager server ---------------------------------------------------------
def test_a_client_without_the_ca_is_refused_and_one_with_it_gets_in(certs):
    with kvmanager(server_tls(certs, mutual=False)) as server:
        target = f"127.0.0.1:{server.port}"
        refused(target, None)  # plaintext to a TLS port
        e = refused(target, None, grpc.ssl_channel_credentials())  # the system's roots do not know our CA
        assert "CERTIFICATE_VERIFY_FAILED" in e.details() or "handshake" in e.details().lower()
        assert health(target, client_tls(certs)) == health_pb2.HealthCheckResponse.SERVING
        assert health(f"localhost:{server.port}", client_tls(certs)) == health_pb2.HealthCheckResponse.SERVING
        assert KVManagerClient(target, tls=client_tls(certs)).list_workers() == []
        with pytest.raises(KVManagerFailed, match="UNAVAILABLE"):
            KVManagerClient(target, retry_for_s=0).list_workers()


def test_mutual_tls_refuses_a_client_without_a_certificate_or_with_another_cas(certs):
    with kvmanager(server_tls(certs, mutual=True)) as server:
        target = f"127.0.0.1:{server.port}"
        refused(target, client_tls(certs))  # verifies the server, but shows no certificate
        refused(target, client_tls(certs, "stranger"))  # a certificate our CA never signed
        refused(target, None)
        assert health(target, client_tls(certs, "client")) == health_pb2.HealthCheckResponse.SERVING
        # The server's certificate serves as a client certificate too (the gateway's and workers' case).
        assert health(target, client_tls(certs, "server")) == health_pb2.HealthCheckResponse.SERVING


def test_without_client_auth_a_server_with_a_ca_lets_clients_in_without_a_certificate(certs):
    """The gateway's --no-tls-client-auth: its CA verifies what it dials, its API clients need TLS alone."""
    tls = replace(server_tls(certs, mutual=True), client_auth=False)
    assert not tls.mutual and tls.describe() == "TLS"
    with kvmanager(tls) as server:
        assert health(f"127.0.0.1:{server.port}", client_tls(certs)) == health_pb2.HealthCheckResponse.SERVING
    http = HttpServer(hello_app, "127.0.0.1", 0, tls=tls)
    try:
        assert httpx.get(f"https://127.0.0.1:{http.port}/", verify=ssl_context(certs, None)).text == "hello"
    finally:
        http.stop()


def test_a_kvmanager_list_keeps_round_robin_and_health_checks_under_tls(certs):
    """--kvmanager a,b becomes an ipv4: address list: its certificates are verified against the first host as
    written (here 127.0.0.1, an IP SAN), and the health-checked round robin still finds the leader."""
    tls = server_tls(certs, mutual=True)
    with kvmanager(tls) as leader, kvmanager(tls, leading=False) as standby:
        spec = f"127.0.0.1:{standby.port},127.0.0.1:{leader.port}"
        with kvmanager_channel(spec, tls=client_tls(certs, "client")) as channel:
            stub = kvmanager_pb2_grpc.KVManagerServiceStub(channel)
            for _ in range(4):  # each call goes to the leader alone (the standby would answer UNAVAILABLE)
                stub.ListWorkers(kvmanager_pb2.ListWorkersRequest(), timeout=10, wait_for_ready=True)


# -- HTTPS ---------------------------------------------------------------------------------------------------
async def hello_app(scope, receive, send):
    """The smallest ASGI app: 200 "hello" (the HTTP server's TLS is what is tested here)."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"hello"})


def ssl_context(certs, who: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs["ca"].cert))
    if who:
        context.load_cert_chain(certs[who].cert, certs[who].key)
    return context


def test_the_http_server_serves_https_and_with_a_ca_requires_client_certificates(certs):
    server = HttpServer(hello_app, "127.0.0.1", 0, tls=server_tls(certs, mutual=True))
    try:
        assert server.base_url == f"https://127.0.0.1:{server.port}/v1"
        url = f"https://127.0.0.1:{server.port}/"
        assert httpx.get(url, verify=ssl_context(certs, "client")).text == "hello"
        for who in (None, "stranger"):
            with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                httpx.get(url, verify=ssl_context(certs, who))
        with pytest.raises(httpx.ConnectError):  # the client does not trust the server without our CA
            httpx.get(url)
    finally:
        server.stop()


# -- the plaintext warning -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("host", "warns"), [("0.0.0.0", True), ("::", True), ("", True), ("127.0.0.1", False),
                                             ("localhost", False), ("::1", False), ("127.0.0.2", False)])
def test_plaintext_on_a_non_loopback_address_warns(host, warns, caplog):
    with caplog.at_level(logging.WARNING, logger="kvserve.tls"):
        assert warn_if_plaintext("HTTP", host, 8000) is warns
    assert bool(caplog.records) is warns
    if warns:
        assert "plaintext" in caplog.text and "--tls-cert" in caplog.text and ":8000" in caplog.text


PLAINTEXT = re.compile(r"serves plaintext on 0\.0\.0\.0:\d+, a non-loopback address: give --tls-cert")
KVMANAGER_READY = re.compile(r"^kvserve kvmanager ready on [\d.]+:(\d+) \((.*)\) admin token: ")


def tls_env(certs, **more: str) -> dict[str, str]:
    """cli_env with the server certificate, its key and the CA in KVSERVE_TLS_* (as a manifest would set them)."""
    return cli_env(KVSERVE_TLS_CERT=str(certs["server"].cert), KVSERVE_TLS_KEY=str(certs["server"].key),
                   KVSERVE_TLS_CA=str(certs["ca"].cert), **more)


def test_a_kvmanager_on_every_interface_warns_without_tls_and_not_with_it(certs, tmp_path):
    args = ["kvmanager", "--host", "0.0.0.0", "--port", "0", "--no-persistence", "--admin-token", ADMIN_TOKEN]
    for env, warns in ((cli_env(), True), (tls_env(certs), False)):
        stderr = tmp_path / f"kvmanager-{warns}.stderr"
        with service_process(args, KVMANAGER_READY, env, stderr, READY_TIMEOUT_S) as (proc, match):
            assert ("mutual TLS" in match[2]) is not warns
            proc.terminate()
            assert proc.wait(timeout=EXIT_TIMEOUT_S) == 0
        assert bool(PLAINTEXT.search(stderr.read_text())) is warns, stderr.read_text()


# -- bad input -----------------------------------------------------------------------------------------------
def test_load_tls_says_which_flag_and_file_is_wrong(certs, tmp_path):
    server, ca = certs["server"], certs["ca"]
    assert load_tls(None, None, None, server=True) is None
    cases = [((server.cert, None, None, True), r"--tls-cert .*server\.crt needs --tls-key"),
             ((None, server.key, None, False), r"--tls-key .*server\.key needs --tls-cert"),
             ((None, None, ca.cert, True), r"--tls-ca .* on a server needs --tls-cert and --tls-key"),
             ((server.cert, tmp_path / "nope.key", None, True), r"--tls-key .*nope\.key: cannot read it"),
             ((server.cert, certs["client"].key, None, True), r"not a certificate and its private key"),
             ((None, None, server.key, False), r"--tls-ca .*server\.key: holds no CA certificate"),
             ((None, None, tmp_path, False), r"--tls-ca .*: cannot read it")]
    (tmp_path / "junk.pem").write_text("not pem\n")
    cases.append(((None, None, tmp_path / "junk.pem", False), r"--tls-ca .*junk\.pem: not a PEM file"))
    for (cert, key, ca_path, is_server), message in cases:
        with pytest.raises(TlsError, match=message):
            load_tls(cert, key, ca_path, server=is_server)
    with pytest.raises(TlsError, match="--tls-server-name needs TLS"):
        load_tls(None, None, None, server=False, server_name="kvmanager")


def test_bad_tls_flags_exit_2_with_the_flag_and_path_before_anything_starts(certs, tmp_path):
    server, missing = certs["server"], tmp_path / "missing.crt"
    data_dir = tmp_path / "kvmanager-data"
    unreadable = tmp_path / "a-folder.key"  # unreadable as a file whoever runs this (root reads a mode-000 file)
    unreadable.mkdir()
    runs = [
        (["kvmanager", "--port", "0", "--data-dir", str(data_dir), "--tls-cert", str(server.cert)],
         f"kvserve: --tls-cert {server.cert} needs --tls-key too"),
        (["worker", "--port", "0", "--tls-cert", str(missing), "--tls-key", str(server.key)],
         f"kvserve: --tls-cert {missing}: cannot read it: No such file or directory"),
        (["gateway", "--port", "0", "--http-port", "0", "--tls-ca", str(certs["ca"].cert)],
         "needs --tls-cert and --tls-key"),
        (["admin", "stats", "--admin-token", "x", "--tls-ca", str(missing)], f"--tls-ca {missing}: cannot read it"),
        (["generate", "--prompt", "hi", "--tls-ca", str(server.key)], "holds no CA certificate"),
        (["info", "--tls-cert", str(certs["client"].cert)], "needs --tls-key too"),
        (["kvmanager", "--port", "0", "--data-dir", str(data_dir), "--tls-cert", str(server.cert), "--tls-key",
          str(unreadable)], f"kvserve: --tls-key {unreadable}: cannot read it: Is a directory"),
    ]
    for args, message in runs:
        out = run_cli(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert message in out.stderr, (args, out.stderr)
    assert not (data_dir / "redis").exists()  # the embedded Redis never started


# -- the whole stack under mutual TLS, as processes ----------------------------------------------------------
@pytest.fixture(scope="module")
def mtls_stack(certs, tmp_path_factory):
    """kvmanager, a worker that joins it, and the gateway, as `kvserve` processes, all with the server
    certificate and the CA: every hop is mutual TLS. The kvmanager and worker get them from KVSERVE_TLS_*, the
    gateway from its flags."""
    tmp = tmp_path_factory.mktemp("mtls-stack")
    stack = contextlib.ExitStack()
    with stack:
        kv, kv_match = stack.enter_context(service_process(
            ["kvmanager", "--port", "0", "--no-persistence", "--admin-token", ADMIN_TOKEN], KVMANAGER_READY,
            tls_env(certs), tmp / "kvmanager.stderr", READY_TIMEOUT_S))
        assert "mutual TLS" in kv_match[2]
        kvmanager_address = f"127.0.0.1:{kv_match[1]}"
        worker, _ = stack.enter_context(service_process(
            ["worker", "--port", "0", "--num-pages", "64", "--worker-id", "w-tls", "--kvmanager", kvmanager_address],
            re.compile(r"^kvserve worker w-tls ready on 127\.0\.0\.1:\d+: .*mutual TLS; joined the kvmanager"),
            tls_env(certs), tmp / "worker.stderr", READY_TIMEOUT_S))
        server = certs["server"]
        gateway, gw_match = stack.enter_context(service_process(
            ["gateway", "--port", "0", "--http-port", "0", "--kvmanager", kvmanager_address,
             "--tls-cert", str(server.cert), "--tls-key", str(server.key), "--tls-ca", str(certs["ca"].cert)],
            re.compile(r"^kvserve gateway ready on 127\.0\.0\.1:(\d+) \(HTTP (https://\S+), 1 workers, .*mutual TLS\)"),
            cli_env(), tmp / "gateway.stderr", READY_TIMEOUT_S))
        yield {"kvmanager": kvmanager_address, "gateway": f"127.0.0.1:{gw_match[1]}", "http": gw_match[2],
               "procs": (gateway, worker, kv), "tmp": tmp}


PROMPT_IDS = [1, 504, 3458, 282, 253, 1345, 30, 2156, 288]  # a few tokens of the model's vocabulary
MAX_TOKENS = 12


def test_the_sdk_generates_over_mutual_tls_as_hf_does(mtls_stack, certs, hf_greedy):
    client_cert = certs["client"]
    credentials = tls_credentials(ca=str(certs["ca"].cert), cert=str(client_cert.cert), key=str(client_cert.key))
    with Client(mtls_stack["gateway"], credentials=credentials, timeout_s=120) as client:
        got = client.complete(prompt_token_ids=PROMPT_IDS, max_tokens=MAX_TOKENS, temperature=0.0)
    assert list(got.token_ids) == hf_greedy(PROMPT_IDS, MAX_TOKENS)
    without_cert = tls_credentials(ca=str(certs["ca"].cert))
    with Client(mtls_stack["gateway"], credentials=without_cert, timeout_s=5) as client:
        with pytest.raises(Unavailable):  # the gateway wants a client certificate
            client.complete(prompt_token_ids=PROMPT_IDS, max_tokens=1)


def test_the_openai_client_over_https_with_a_client_certificate(mtls_stack, certs, hf_greedy, tokenizer):
    prompt = "The capital of France is"
    with httpx.Client(verify=ssl_context(certs, "client"), timeout=120) as http, \
            openai.OpenAI(base_url=mtls_stack["http"], api_key="none", http_client=http, max_retries=0) as c:
        got = c.completions.create(model=c.models.list().data[0].id, prompt=prompt, max_tokens=MAX_TOKENS,
                                   temperature=0)
    assert got.choices[0].text == tokenizer.decode(hf_greedy(tokenizer.encode(prompt), MAX_TOKENS))
    with httpx.Client(verify=ssl_context(certs, None), timeout=10) as http, \
            openai.OpenAI(base_url=mtls_stack["http"], api_key="none", http_client=http, max_retries=0) as c:
        with pytest.raises(openai.APIConnectionError):
            c.models.list()


def test_the_cli_dials_the_kvmanager_and_the_gateway_with_its_tls_flags(mtls_stack, certs):
    client_cert = certs["client"]
    flags = ["--tls-ca", str(certs["ca"].cert), "--tls-cert", str(client_cert.cert), "--tls-key",
             str(client_cert.key)]
    out = run_cli("admin", "stats", "--json", "--kvmanager", mtls_stack["kvmanager"], "--admin-token", ADMIN_TOKEN,
                  *flags)
    assert out.returncode == 0, out.stderr
    assert '"worker_id": "w-tls"' in out.stdout
    no_cert = run_cli("admin", "stats", "--kvmanager", mtls_stack["kvmanager"], "--admin-token", ADMIN_TOKEN,
                      "--timeout", "3", "--tls-ca", str(certs["ca"].cert))
    assert no_cert.returncode == 1 and "UNAVAILABLE" in no_cert.stderr, no_cert.stderr
    out = run_cli("generate", "--gateway", mtls_stack["gateway"], "--prompt", "Hello", "--max-tokens", "3", *flags)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


def test_the_tls_stack_stops_cleanly(mtls_stack):
    """Last in this file: SIGTERM to each process (gateway first) exits 0."""
    for proc in mtls_stack["procs"]:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
