"""`gpupool k8s serve` and `gpupool agent --device-plugin` refuse bad input with one line and
exit 2, before serving anything."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpupool.cli.main import app

API = ["--kube-api", "http://127.0.0.1:9"]
OPEN_EXT = ["--insecure-unauthenticated-extender"]
TOKEN = ["--webhook-token-file", "{file}"]
EXTRA_CA = ["--extra-client-ca", "{file}"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["k8s", "serve", "--tls-cert", "{file}"], "give both --tls-cert and --tls-key"),
        (["k8s", "serve", "--tls-cert", "{missing}", "--tls-key", "{file}"], "no file"),
        (["k8s", "serve", "--port", "0"], "--port must be 1..65535"),
        (["k8s", "serve", "--token-secret", "only-a-name"], "--token-secret must be SECRET/KEY"),
        (["k8s", "serve", "--kube-api", "ftp://api"], "--kube-api must be an http"),
        (["k8s", "serve", "--sweep-interval", "0"], "--sweep-interval must be more than 0"),
        (["k8s", "serve"], "not in a Kubernetes pod"),
        (["k8s", "serve", *API], "the scheduler must authenticate to /extender/"),
        (
            ["k8s", "serve", *API, "--insecure-unauthenticated-extender"],
            "the API server must authenticate to /webhook/",
        ),
        (
            ["k8s", "serve", *API, "--extender-client", "gpupool-scheduler"],
            "--extender-client needs --client-ca",
        ),
        (["k8s", "serve", *API, "--client-ca", "{file}"], "--client-ca needs TLS"),
        (
            ["k8s", "serve", *API, "--insecure-unauthenticated-webhook", *TOKEN, *OPEN_EXT],
            "--insecure-unauthenticated-webhook admits everyone",
        ),
        (
            ["k8s", "serve", *API, *OPEN_EXT, *TOKEN],
            "a token of 16 characters or more",
        ),
        (
            ["k8s", "serve", *API, *OPEN_EXT, "--webhook-token-file", "{missing}"],
            "--webhook-token-file",
        ),
        (["k8s", "serve", *API, "--max-body-mib", "0"], "--max-body-mib must be 1..1024"),
        (["k8s", "serve", *API, "--runtime-class", "Not_A_Name"], "--runtime-class must be"),
        (["k8s", "serve", "--kube-token-file", "{file}"], "go with --kube-api URL"),
        (["k8s", "serve", *API, "--webhook-configuration", "w"], "needs --tls-ca"),
        (["k8s", "init-secrets", *API, "--service", "s"], "give --namespace"),
        (
            [
                "k8s",
                "init-secrets",
                *API,
                "--namespace",
                "n",
                "--service",
                "s",
                "--postgresql",
                "p",
            ],
            "--postgresql needs --postgresql-host",
        ),
        (
            ["k8s", "init-secrets", *API, "--namespace", "n", "--service", "s", *EXTRA_CA],
            "not a PEM certificate",
        ),
        (["agent", "--fake", "1xH100-80GB", "--cdi-devices", "all"], "--cdi-devices must be"),
        (["agent", "--fake", "1xH100-80GB", "--vgpu-slots", "0"], "--vgpu-slots must be 1..100"),
        (["agent", "--fake", "1xH100-80GB", "--room-timeout", "0"], "--room-timeout must be in"),
        (
            ["agent", "--fake", "1xH100-80GB", "--device-plugin", "--kubelet-dir", "{missing}"],
            "is not a directory",
        ),
        (
            ["agent", "--fake", "1xH100-80GB", "--device-plugin", "--kubelet-dir", "{dir}"],
            "--insecure-no-pod-check",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    (tmp_path / "file.pem").write_text("x")
    filled = [
        a.format(file=tmp_path / "file.pem", missing=tmp_path / "missing", dir=tmp_path)
        for a in args
    ]
    result = CliRunner().invoke(app, ["--url", "http://127.0.0.1:9", *filled])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert message in lines[0]
