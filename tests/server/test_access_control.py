"""Access control and TLS on a real `strata serve`: tritonserver's restricted-API flags passed through (and
--access-token as their short form), gRPC over TLS with tritonclient, the OpenAI port over HTTPS with --api-key.

The certificate is self-signed, made at run time for localhost and 127.0.0.1.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from tritonclient.utils import InferenceServerException

from harness.servers import copy_models

pytestmark = pytest.mark.slow


def self_signed(folder: Path) -> tuple[Path, Path]:
    """(certificate, key) PEM files for localhost and 127.0.0.1, valid for a day."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def upper(client, module, text: bytes) -> bytes:
    tensor = module.InferInput("TEXT", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[text]], dtype=object))
    return client.infer("string_upper", [tensor]).as_numpy("UPPER").reshape(-1)[0]


def test_restricted_apis_pass_through_to_triton(strata, tmp_path):
    repo = copy_models(tmp_path / "repo", "string_upper")
    server = strata(
        repo,
        "--model-control-mode",
        "explicit",
        "--load-model",
        "string_upper",
        "--http-restricted-api",
        "model-repository,statistics:triton-access-token=s3cret",
        "--grpc-restricted-protocol",
        "model-repository:triton-access-token=s3cret",
        "--http-restricted-api",
        "trace:x-trace-key=t0k",
    )
    http = httpclient.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException, match="(?i)unauthorized|permission|restricted"):
        http.get_model_repository_index()
    assert {
        m["name"] for m in http.get_model_repository_index(headers={"triton-access-token": "s3cret"})
    } == {"string_upper"}
    with pytest.raises(InferenceServerException):
        http.get_inference_statistics(headers={"triton-access-token": "wrong"})
    with pytest.raises(InferenceServerException):
        http.get_trace_settings()
    http.get_trace_settings(headers={"x-trace-key": "t0k"})
    assert upper(http, httpclient, b"open") == b"OPEN"  # inference stays open
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException):
        grpc.get_model_repository_index()
    grpc.unload_model("string_upper", headers={"triton-grpc-protocol-triton-access-token": "s3cret"})
    assert not http.is_model_ready("string_upper")


def test_access_token_is_the_short_form(strata, tmp_path):
    repo = copy_models(tmp_path / "repo", "string_upper")
    server = strata(repo, "--access-token", "tok")
    http = httpclient.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException):
        http.get_model_repository_index()
    assert http.get_model_repository_index(headers={"triton-access-token": "tok"})
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException):
        grpc.get_inference_statistics()
    assert grpc.get_inference_statistics(headers={"triton-grpc-protocol-triton-access-token": "tok"})


def test_a_restriction_that_locks_strata_out_is_refused_at_start(strata, tmp_path):
    repo = copy_models(tmp_path / "repo", "string_upper")
    server = strata(repo, "--http-restricted-api", "model-repository:x-key=v", wait_ready=False)
    assert server.process.wait(60) == 2
    assert "--http-restricted-api model-repository: Strata's own control calls" in server.log()


def test_grpc_and_openai_over_tls(strata, tmp_path):
    cert, key = self_signed(tmp_path)
    repo = copy_models(tmp_path / "repo", "string_upper")
    server = strata(
        repo,
        "--grpc-use-ssl",
        "--grpc-server-cert",
        str(cert),
        "--grpc-server-key",
        str(key),
        "--ssl-certfile",
        str(cert),
        "--ssl-keyfile",
        str(key),
        "--api-key",
        "sk-local",
    )
    secure = grpcclient.InferenceServerClient(
        f"localhost:{server.grpc_port}", ssl=True, root_certificates=str(cert)
    )
    assert upper(secure, grpcclient, b"tls") == b"TLS"
    plain = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException):
        plain.is_server_live()

    base = f"https://localhost:{server.openai_port}"
    trusted = httpx.Client(verify=ssl.create_default_context(cafile=str(cert)))
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-local", http_client=trusted, max_retries=0)
    assert client.models.list().data == []  # no LLM in this repository: the port answers, authenticated
    assert trusted.get(f"{base}/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=f"{base}/v1", api_key="wrong", http_client=trusted, max_retries=0
        ).models.list()
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port
        httpx.get(f"http://127.0.0.1:{server.openai_port}/health", timeout=5)
