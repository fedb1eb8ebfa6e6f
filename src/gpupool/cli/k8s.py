"""`gpupool k8s`: gpupool's pieces that run inside a Kubernetes cluster."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from gpupool.cli.context import cli_context
from gpupool.cli.errors import BadInput, CommandFailed

if TYPE_CHECKING:
    from gpupool.k8s.callers import CallerRule
    from gpupool.k8s.kube import KubeCredentials

app = typer.Typer(no_args_is_help=True)
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
"""An object name's rule (RuntimeClass names are DNS subdomains)."""


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
    tls_ca: Annotated[
        Path | None,
        typer.Option(
            "--tls-ca", help="CA (PEM) that signed --tls-cert, for --webhook-configuration."
        ),
    ] = None,
    webhook_configuration: Annotated[
        str | None,
        typer.Option(
            "--webhook-configuration",
            help="MutatingWebhookConfiguration whose caBundle is set to --tls-ca at start.",
        ),
    ] = None,
    kube_api: Annotated[
        str | None,
        typer.Option("--kube-api", help="API server URL (default: the cluster this pod is in)."),
    ] = None,
    kube_token_file: Annotated[
        Path | None,
        typer.Option(
            "--kube-token-file",
            help="File with the bearer token for --kube-api (read again when it changes).",
        ),
    ] = None,
    kube_ca_file: Annotated[
        Path | None,
        typer.Option(
            "--kube-ca-file", help="CA (PEM) of --kube-api's certificate (default: the system's)."
        ),
    ] = None,
    scheduler_name: Annotated[
        str,
        typer.Option(
            "--scheduler-name", help="Scheduler (with this extender) for GPU pods; '' keeps theirs."
        ),
    ] = "gpupool-scheduler",
    runtime_class: Annotated[
        str,
        typer.Option(
            "--runtime-class",
            help="RuntimeClass set on direct GPU pods (e.g. nvidia); '' leaves theirs alone.",
        ),
    ] = "",
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
    client_ca: Annotated[
        Path | None,
        typer.Option(
            "--client-ca",
            help="CA (PEM) whose client certificates the scheduler and API server present.",
        ),
    ] = None,
    extender_client: Annotated[
        list[str] | None,
        typer.Option(
            "--extender-client",
            help="Certificate name (CN or DNS SAN) the scheduler presents; repeatable.",
        ),
    ] = None,
    webhook_client: Annotated[
        list[str] | None,
        typer.Option(
            "--webhook-client",
            help="Certificate name (CN or DNS SAN) the API server presents; repeatable.",
        ),
    ] = None,
    extender_token_file: Annotated[
        Path | None,
        typer.Option("--extender-token-file", help="File with the bearer token of the scheduler."),
    ] = None,
    webhook_token_file: Annotated[
        Path | None,
        typer.Option("--webhook-token-file", help="File with the bearer token of the API server."),
    ] = None,
    insecure_extender: Annotated[
        bool,
        typer.Option(
            "--insecure-unauthenticated-extender",
            help="INSECURE: let anyone who reaches the port call the extender (bind pods).",
        ),
    ] = False,
    insecure_webhook: Annotated[
        bool,
        typer.Option(
            "--insecure-unauthenticated-webhook",
            help="INSECURE: let anyone who reaches the port call the admission webhook.",
        ),
    ] = False,
    max_body_mib: Annotated[
        int,
        typer.Option("--max-body-mib", help="Refuse request bodies over this many MiB (413)."),
    ] = 16,
) -> None:
    """Serve the scheduler extender (/extender/...) and the admission webhook (/webhook/mutate).

    Every caller must authenticate: the scheduler with a client certificate
    (--client-ca, --extender-client; its KubeSchedulerConfiguration's tlsConfig certFile/
    keyFile) or a token, the API server with a client certificate (--webhook-client) or a
    token (--webhook-token-file; its AdmissionConfiguration kubeconfig). Only an
    --insecure-... flag serves a group without.
    """
    if (tls_cert is None) != (tls_key is None):
        raise BadInput("give both --tls-cert and --tls-key, or neither")
    for path in (tls_cert, tls_key):
        if path is not None and not path.is_file():
            raise BadInput(f"no file {path}")
    if webhook_configuration is not None and tls_ca is None:
        raise BadInput("--webhook-configuration needs --tls-ca (the CA to put in its caBundle)")
    if tls_ca is not None and not tls_ca.is_file():
        raise BadInput(f"no file {tls_ca}")
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
    kube = kube_credentials(kube_api, kube_token_file, kube_ca_file)
    if runtime_class and not DNS_SUBDOMAIN.match(runtime_class):
        raise BadInput(f"--runtime-class must be a RuntimeClass name, got {runtime_class!r}")
    if not 1 <= max_body_mib <= 1024:
        raise BadInput(f"--max-body-mib must be 1..1024, got {max_body_mib}")
    from gpupool.k8s.app import ServeSettings
    from gpupool.k8s.app import serve as run
    from gpupool.k8s.callers import Callers
    from gpupool.k8s.webhook import WebhookSettings

    if client_ca is not None:
        if tls_cert is None:
            raise BadInput("--client-ca needs TLS: give --tls-cert and --tls-key too")
        if not client_ca.is_file():
            raise BadInput(f"no file {client_ca}")
    callers = Callers.of(
        caller_rule(
            "scheduler",
            "extender",
            client_ca,
            extender_client or [],
            extender_token_file,
            insecure_extender,
        ),
        caller_rule(
            "API server",
            "webhook",
            client_ca,
            webhook_client or [],
            webhook_token_file,
            insecure_webhook,
        ),
    )
    url = cli_context(ctx).url
    run(
        ServeSettings(
            controller_url=url,
            kube=kube,
            host=host,
            port=port,
            tls_cert=str(tls_cert) if tls_cert else None,
            tls_key=str(tls_key) if tls_key else None,
            sweep_interval_s=sweep_interval,
            callers=callers,
            client_ca=str(client_ca) if client_ca else None,
            max_body_bytes=max_body_mib * 1024 * 1024,
            webhook_configuration=webhook_configuration,
            tls_ca=str(tls_ca) if tls_ca else None,
            webhook=WebhookSettings(
                scheduler_name=scheduler_name or None,
                controller_url=pod_controller_url or url,
                token_secret=secret,
                runtime_class=runtime_class or None,
            ),
        )
    )


@app.command("init-secrets")
def init_secrets(
    service: Annotated[
        str, typer.Option("--service", help="The webhook's Service (its certificate's names).")
    ],
    namespace: Annotated[
        str | None,
        typer.Option("--namespace", help="Where the Secrets go (default: this pod's namespace)."),
    ] = None,
    admin_token: Annotated[
        str | None, typer.Option("--admin-token", help="Secret of the controller's admin token.")
    ] = None,
    webhook_token: Annotated[
        str | None,
        typer.Option("--webhook-token", help="Secret of the token the API server presents."),
    ] = None,
    tls: Annotated[
        str | None,
        typer.Option("--tls", help="kubernetes.io/tls Secret of the Service (with ca.crt)."),
    ] = None,
    scheduler_client: Annotated[
        str | None,
        typer.Option("--scheduler-client", help="kubernetes.io/tls Secret of the scheduler."),
    ] = None,
    scheduler_client_name: Annotated[
        str, typer.Option("--scheduler-client-name", help="CN of the scheduler's certificate.")
    ] = "gpupool-scheduler",
    client_ca: Annotated[
        str | None,
        typer.Option("--client-ca", help="Secret of the CAs whose client certificates count."),
    ] = None,
    extra_client_ca: Annotated[
        list[Path] | None,
        typer.Option("--extra-client-ca", help="PEM file of another CA for --client-ca."),
    ] = None,
    postgresql: Annotated[
        str | None,
        typer.Option("--postgresql", help="Secret of the bundled PostgreSQL (password, url)."),
    ] = None,
    postgresql_host: Annotated[str, typer.Option("--postgresql-host")] = "",
    postgresql_user: Annotated[str, typer.Option("--postgresql-user")] = "gpupool",
    postgresql_database: Annotated[str, typer.Option("--postgresql-database")] = "gpupool",
    kube_api: Annotated[
        str | None, typer.Option("--kube-api", help="API server URL (default: in-cluster).")
    ] = None,
    kube_token_file: Annotated[Path | None, typer.Option("--kube-token-file")] = None,
    kube_ca_file: Annotated[Path | None, typer.Option("--kube-ca-file")] = None,
) -> None:
    """Create the chart's Secrets that are missing; never change one that exists.

    The chart's pre-install/pre-upgrade Job runs this, so `helm template` renders no secret
    (stable for GitOps) and the credentials are made once, inside the cluster.
    """
    import asyncio

    from gpupool.k8s.kube import SERVICE_ACCOUNT, KubeApi, KubeError
    from gpupool.k8s.secrets import InitError, SecretNames
    from gpupool.k8s.secrets import init_secrets as run

    kube = kube_credentials(kube_api, kube_token_file, kube_ca_file)
    if namespace is None:
        try:
            namespace = (SERVICE_ACCOUNT / "namespace").read_text().strip()
        except OSError:
            raise BadInput("give --namespace (not in a pod with a service account)") from None
    if postgresql and not postgresql_host:
        raise BadInput("--postgresql needs --postgresql-host (its Service's DNS name)")
    extra = []
    for path in extra_client_ca or []:
        try:
            text = path.read_text()
        except OSError as exc:
            raise BadInput(f"--extra-client-ca {path}: {exc.strerror}") from None
        if "-----BEGIN CERTIFICATE-----" not in text:
            raise BadInput(f"--extra-client-ca {path}: not a PEM certificate")
        extra.append(text)
    names = SecretNames(
        namespace=namespace,
        service=service,
        admin_token=admin_token,
        webhook_token=webhook_token,
        tls=tls,
        scheduler_client=scheduler_client,
        scheduler_client_name=scheduler_client_name,
        client_ca=client_ca,
        extra_client_cas=extra,
        postgresql=postgresql,
        postgresql_host=postgresql_host,
        postgresql_user=postgresql_user,
        postgresql_database=postgresql_database,
    )

    async def go() -> None:
        client = KubeApi.of(kube)
        try:
            outcome = await run(client, names)
        finally:
            await client.close()
        typer.echo(
            f"created: {', '.join(outcome.created) or 'none'}; "
            f"kept: {', '.join(outcome.kept) or 'none'}"
        )

    try:
        asyncio.run(go())
    except (KubeError, InitError) as exc:
        raise CommandFailed(str(exc)) from None


def kube_credentials(
    url: str | None, token_file: Path | None, ca_file: Path | None
) -> KubeCredentials:
    """The API server and our credential for it: the flags, else the pod's service account."""
    from gpupool.k8s.kube import KubeCredentials, KubeError, TokenFileAuth

    if url is None:
        if token_file is not None or ca_file is not None:
            raise BadInput("--kube-token-file and --kube-ca-file go with --kube-api URL")
        try:
            return KubeCredentials.in_cluster()
        except KubeError as exc:
            raise BadInput(str(exc)) from None
    if not url.startswith(("http://", "https://")):
        raise BadInput(f"--kube-api must be an http:// or https:// URL, got {url!r}")
    if token_file is not None:
        if url.startswith("http://"):
            raise BadInput("--kube-token-file needs an https:// --kube-api (the token is secret)")
        try:
            TokenFileAuth(token_file)
        except KubeError as exc:
            raise BadInput(f"--kube-token-file: {exc}") from None
    if ca_file is not None and not ca_file.is_file():
        raise BadInput(f"--kube-ca-file: no file {ca_file}")
    return KubeCredentials(url, token_file, ca_file)


def caller_rule(
    role: str,
    group: str,
    client_ca: Path | None,
    names: list[str],
    token_file: Path | None,
    insecure: bool,
) -> CallerRule:
    """The rule of one group of endpoints from its flags; BadInput where it admits no one,
    or contradicts itself."""
    from gpupool.k8s.callers import CallerRule, token_digest

    flag = f"--insecure-unauthenticated-{group}"
    if insecure and (names or token_file is not None):
        raise BadInput(f"{flag} admits everyone: give it or --{group}-client/-token-file")
    if insecure:
        return CallerRule(role, insecure=True)
    cleaned = frozenset(n.strip() for n in names if n.strip())
    if len(cleaned) != len(names):
        raise BadInput(f"--{group}-client must be a certificate name, not empty")
    if cleaned and client_ca is None:
        raise BadInput(f"--{group}-client needs --client-ca (the CA that signed the certificate)")
    digest = None
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise BadInput(f"--{group}-token-file {token_file}: {exc.strerror}") from None
        if len(token) < 16:
            raise BadInput(f"--{group}-token-file {token_file}: a token of 16 characters or more")
        digest = token_digest(token)
    if not cleaned and digest is None:
        raise BadInput(
            f"the {role} must authenticate to /{group}/: give --{group}-client NAME (with "
            f"--client-ca) or --{group}-token-file, or {flag} to serve anyone"
        )
    return CallerRule(role, certificate_names=cleaned, token_sha256=digest)
