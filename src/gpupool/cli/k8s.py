"""`gpupool k8s`: gpupool's pieces that run inside a Kubernetes cluster."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from gpupool.cli.context import cli_context
from gpupool.cli.errors import BadInput

app = typer.Typer(no_args_is_help=True)


@app.command("serve")
def serve(
    ctx: typer.Context,
    port: Annotated[int, typer.Option("--port", help="Port of the extender and webhook.")] = 8443,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "0.0.0.0",
    tls_cert: Annotated[
        Path | None,
        typer.Option("--tls-cert", help="TLS certificate (the API server needs HTTPS)."),
    ] = None,
    tls_key: Annotated[Path | None, typer.Option("--tls-key", help="TLS private key.")] = None,
    kube_api: Annotated[
        str | None,
        typer.Option("--kube-api", help="API server URL (default: the cluster this pod is in)."),
    ] = None,
    scheduler_name: Annotated[
        str,
        typer.Option(
            "--scheduler-name", help="Scheduler (with this extender) for GPU pods; '' keeps theirs."
        ),
    ] = "gpupool-scheduler",
    pod_controller_url: Annotated[
        str | None,
        typer.Option(
            "--pod-controller-url", help="Controller URL remote-access pods use (default: --url)."
        ),
    ] = None,
    token_secret: Annotated[
        str | None,
        typer.Option(
            "--token-secret", help="SECRET/KEY whose value remote pods get as GPUPOOL_TOKEN."
        ),
    ] = None,
    sweep_interval: Annotated[
        float, typer.Option("--sweep-interval", help="Seconds between claim checks.")
    ] = 10.0,
) -> None:
    """Serve the scheduler extender (/extender/...) and the admission webhook (/webhook/mutate)."""
    if (tls_cert is None) != (tls_key is None):
        raise BadInput("give both --tls-cert and --tls-key, or neither")
    for path in (tls_cert, tls_key):
        if path is not None and not path.is_file():
            raise BadInput(f"no file {path}")
    if not 0 < port < 65536:
        raise BadInput(f"--port must be 1..65535, got {port}")
    if sweep_interval <= 0:
        raise BadInput(f"--sweep-interval must be more than 0, got {sweep_interval:g}")
    secret: tuple[str, str] | None = None
    if token_secret is not None:
        name, _, key = token_secret.partition("/")
        if not name or not key:
            raise BadInput(f"--token-secret must be SECRET/KEY, got {token_secret!r}")
        secret = (name, key)
    if kube_api is not None and not kube_api.startswith(("http://", "https://")):
        raise BadInput(f"--kube-api must be an http:// or https:// URL, got {kube_api!r}")
    if kube_api is None and not os.environ.get("KUBERNETES_SERVICE_HOST"):
        raise BadInput("not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST): give --kube-api URL")
    from gpupool.k8s.app import ServeSettings
    from gpupool.k8s.app import serve as run
    from gpupool.k8s.webhook import WebhookSettings

    url = cli_context(ctx).url
    run(
        ServeSettings(
            controller_url=url,
            kube_api=kube_api,
            host=host,
            port=port,
            tls_cert=str(tls_cert) if tls_cert else None,
            tls_key=str(tls_key) if tls_key else None,
            sweep_interval_s=sweep_interval,
            webhook=WebhookSettings(
                scheduler_name=scheduler_name or None,
                controller_url=pod_controller_url or url,
                token_secret=secret,
            ),
        )
    )
