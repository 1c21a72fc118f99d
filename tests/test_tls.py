"""TLS settings (cluster/tls.py): vLLM's `--ssl-*` flags and config keys, refused when they
cannot work, before anything starts. A TLS server itself is test_serve_vllm_compat's.

tests/data/tls holds test-only certificates, made once with `openssl` (valid to 2126): a
CA (ca.pem), a server certificate it signed for 127.0.0.1 and localhost (server.pem,
server.key; server-encrypted.key is that key under the password "secret"), a client
certificate it signed (client.pem, client.key) and one it did not (rogue.pem, rogue.key).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from cli_in_process import cli_main

from pdserve.cluster.serve_args import ServeConfig
from pdserve.cluster.serve_flags import add_serve_args, config_from_args
from pdserve.cluster.serve_process import free_port
from pdserve.cluster.tls import TlsConfig

TLS = Path(__file__).parent / "data" / "tls"
CERT, KEY, CA = str(TLS / "server.pem"), str(TLS / "server.key"), str(TLS / "ca.pem")


def _args(*argv: str) -> ServeConfig:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return config_from_args(p.parse_args(list(argv)))


def test_flags_and_config_keys_reach_uvicorn(tmp_path):
    """The flags and the config file's keys of the same names give uvicorn the files;
    without --ssl-certfile the server stays plain HTTP."""
    assert _args().tls == TlsConfig() and not _args().tls.enabled
    assert TlsConfig().uvicorn_kwargs() == {} and TlsConfig().scheme == "http"
    cfg = _args("--ssl-certfile", CERT, "--ssl-keyfile", KEY, "--ssl-ca-certs", CA,
                "--ssl-cert-reqs", "2", "--ssl-ciphers", "ECDHE+AESGCM")  # fmt: skip
    assert cfg.tls.scheme == "https"
    assert cfg.tls.uvicorn_kwargs() == {
        "ssl_certfile": CERT, "ssl_keyfile": KEY, "ssl_ca_certs": CA, "ssl_cert_reqs": 2,
        "ssl_ciphers": "ECDHE+AESGCM",
    }  # fmt: skip
    cfg.tls.load_check()
    path = tmp_path / "serve.yaml"
    path.write_text(f"ssl_certfile: {CERT}\nssl-keyfile: {KEY}\n")
    assert _args("--config", str(path)).tls == TlsConfig(CERT, KEY)
    path.write_text("ssl_cert_reqs: required\n")
    with pytest.raises(ValueError, match="ssl_cert_reqs must be an integer"):
        _args("--config", str(path))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(keyfile=KEY), "--ssl-keyfile: TLS needs --ssl-certfile"),
        (dict(ca_certs=CA, cert_reqs=2), "--ssl-ca-certs, --ssl-cert-reqs: TLS needs --ssl-cert"),
        (dict(ciphers="HIGH"), "--ssl-ciphers: TLS needs --ssl-certfile"),
        (dict(certfile=CERT, cert_reqs=2), "--ssl-cert-reqs 2 (required) checks client "
         "certificates: name the CA that signs them with --ssl-ca-certs"),
        (dict(certfile=CERT, cert_reqs=3), "--ssl-cert-reqs must be 0 (no client certificate), "
         "1 (optional) or 2 (required), got 3"),
        (dict(certfile=CERT, cert_reqs=True), "--ssl-cert-reqs must be 0"),
        (dict(certfile=""), "--ssl-certfile must be a non-empty string"),
    ],
)  # fmt: skip
def test_flag_combinations_that_cannot_work_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TlsConfig(**kwargs)
    flags = {"certfile": "ssl_certfile", "keyfile": "ssl_keyfile", "ca_certs": "ssl_ca_certs",
             "cert_reqs": "ssl_cert_reqs", "ciphers": "ssl_ciphers"}  # fmt: skip
    with pytest.raises(ValueError):  # ServeConfig checks them as it is made
        ServeConfig(**{flags[k]: v for k, v in kwargs.items()})


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(keyfile=str(TLS / "server-encrypted.key")),
         "cannot load the certificate and its key: the key is encrypted; pdserve takes a key "
         "without a password"),
        (dict(keyfile=str(TLS / "client.key")), "KEY_VALUES_MISMATCH"),
        (dict(certfile=str(TLS / "none.pem"), keyfile=None), "--ssl-certfile "
         f"{TLS / 'none.pem'}: cannot load the certificate and its key: .*No such file"),
        (dict(ca_certs=KEY, cert_reqs=1), f"--ssl-ca-certs {KEY}: cannot load it"),
        (dict(ciphers="NO-SUCH-CIPHER"), "OpenSSL selects no cipher by it"),
    ],
)  # fmt: skip
def test_files_are_loaded_as_the_server_loads_them(kwargs, message):
    """An encrypted key (OpenSSL would ask for its password on the terminal: a server
    under Kubernetes would wait for ever), a key of another certificate, a missing file, a
    CA file with no certificate in it, ciphers OpenSSL does not know: refused by name."""
    tls = TlsConfig(**{"certfile": CERT, "keyfile": KEY, **kwargs})
    with pytest.raises(ValueError, match=message):
        tls.load_check()


def test_serve_refuses_a_bad_key_before_ray_and_run_batch_its_own_tls_server(tmp_path):
    """`pdserve serve` loads the files before Ray or the model (a refusal in well under a
    second, nothing started); `run-batch` refuses TLS for the server it starts for itself
    (a child only it calls), and takes it for a server it is pointed at."""
    port = str(free_port())
    code, err = cli_main("serve", "--port", port, "--ssl-certfile", CERT, "--ssl-keyfile",
                         str(TLS / "client.key"))  # fmt: skip
    assert code == 2 and "cannot load the certificate and its key" in err, err
    assert "Ray" not in err
    batch = tmp_path / "in.jsonl"
    batch.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
                     '"body": {"prompt": "x"}}\n')  # fmt: skip
    code, err = cli_main("run-batch", "-i", str(batch), "-o", str(tmp_path / "out.jsonl"),
                         "--ssl-certfile", CERT, "--ssl-keyfile", KEY)  # fmt: skip
    assert code == 2 and "run-batch's own server is a child on 127.0.0.1" in err, err
