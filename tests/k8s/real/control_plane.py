"""A real Kubernetes control plane for the end-to-end tests, in a network namespace of its own.

etcd, kube-apiserver v1.20.2, kube-scheduler (the chart's configuration, with gpupool's
extender) and a kubelet on the kubelet's own fake container runtime, plus the gpupool
processes they talk to (controller, `gpupool k8s serve`, an agent with the device plugin).
Every one runs inside one network namespace that has only loopback, so nothing here can
reach or be reached from another address, and one mount namespace whose /etc/hosts names
the chart's Services (127.0.0.1) and whose /var/lib/kubelet, /var/log/pods and
/var/log/containers are directories of this run (the host's stay untouched; all of it goes
away at the end). A process that runs as one of the chart's pods gets, in a mount namespace
of its own, the files its pod would have mounted (its service account's token, its Secrets)
at the pod's paths, so it runs with the chart's own arguments.

The chart is installed as `helm install` does it (`ControlPlane.helm_install`): the chart
renders no Secret, so its pre-install hook's `gpupool k8s init-secrets` makes them in the
cluster, and the processes get them from the API server, never from the render.

Binaries come from scripts/k8s-control-plane.sh (built from Debian's kubernetes source
package, cached under ~/.cache/gpupool-k8s). The tests talk to the namespace through
`nsenter` (kubectl, the gpupool CLI) and through sockets opened from a thread that joined
the namespace (`in_namespace`).
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

REPO = Path(__file__).resolve().parents[3]
BUILD_SCRIPT = REPO / "scripts" / "k8s-control-plane.sh"
DOCS = REPO / "docs" / "kubernetes.md"
NAMESPACE = "gpupool"
NODE = "gpu-node-1"
API_PORT = 6443
CONTROLLER_PORT = 8900
START_TIMEOUT_S = 180.0
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1

# Static tokens: the admin, users named like the chart's service accounts (so the chart's
# RBAC applies to them as to its pods) and the kubelet's node identity (Node authorizer).
TOKENS = {
    "admin": ("admin", "system:masters"),
    "extender": (f"system:serviceaccount:{NAMESPACE}:gpupool-k8s", "system:serviceaccounts"),
    "scheduler": (
        f"system:serviceaccount:{NAMESPACE}:gpupool-scheduler",
        "system:serviceaccounts",
    ),
    "agent": (f"system:serviceaccount:{NAMESPACE}:gpupool-agent", "system:serviceaccounts"),
    # The chart's pre-install hook Job (`gpupool k8s init-secrets`), with its Role.
    "init-secrets": (
        f"system:serviceaccount:{NAMESPACE}:gpupool-init-secrets",
        "system:serviceaccounts",
    ),
    "node": (f"system:node:{NODE}", "system:nodes"),
}

# What the kubelet would otherwise write into the host's kernel (it sets these sysctls at
# start): it reads them from files of its own mount namespace instead.
KUBELET_SYSCTLS = {
    "/proc/sys/vm/overcommit_memory": "1",
    "/proc/sys/vm/panic_on_oom": "0",
    "/proc/sys/kernel/panic": "10",
    "/proc/sys/kernel/panic_on_oops": "1",
    "/proc/sys/kernel/keys/root_maxkeys": "1000000",
    "/proc/sys/kernel/keys/root_maxbytes": "25000000",
}
CLUSTER_SCOPED = frozenset(
    {
        "ClusterRole",
        "ClusterRoleBinding",
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
        "Namespace",
        "PriorityClass",
        "RuntimeClass",
    }
)
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
HOST_DIRS = ("/var/lib/kubelet", "/var/log/pods", "/var/log/containers")
HOOK = "helm.sh/hook"
WEBHOOK_CONFIGURATION = "gpupool-k8s"

T = TypeVar("T")


class CannotRun(Exception):
    """The control plane cannot run here; the message says why (the tests skip with it)."""


@dataclass(frozen=True)
class Confinement:
    """What a pod's and its container's securityContext make of the container's process, as
    a container runtime applies them: its user, group and fsGroup, no new privileges, no
    capability but the added ones, and a read-only root where only the pod's volumes can be
    written. The chart's processes run so here: whatever they write outside their volumes, or
    need as root, fails here as it would in the pod."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    no_new_privs: bool
    capabilities: tuple[str, ...]
    read_only_root: bool

    @classmethod
    def of(cls, pod: dict[str, Any], container: dict[str, Any]) -> Confinement:
        pod_security = pod.get("securityContext") or {}
        security = container.get("securityContext") or {}
        caps = security.get("capabilities") or {}
        assert caps.get("drop") == ["ALL"], f"{container['name']} keeps the runtime's caps"
        fs_group = pod_security.get("fsGroup")
        return cls(
            uid=int(security.get("runAsUser", pod_security.get("runAsUser", 0))),
            gid=int(security.get("runAsGroup", pod_security.get("runAsGroup", 0))),
            groups=(int(fs_group),) if fs_group is not None else (),
            no_new_privs=security.get("allowPrivilegeEscalation") is False,
            capabilities=tuple(caps.get("add") or ()),
            read_only_root=security.get("readOnlyRootFilesystem") is True,
        )

    def setpriv(self) -> list[str]:
        """util-linux setpriv: the user, groups and capability sets, then exec."""
        caps = ",".join(["-all", *(f"+{c.lower()}" for c in self.capabilities)])
        argv = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}"]
        argv += (
            [f"--groups={','.join(map(str, self.groups))}"] if self.groups else ["--clear-groups"]
        )
        argv += [f"--inh-caps={caps}", f"--bounding-set={caps}"]
        if self.capabilities and self.uid != 0:
            argv += [f"--ambient-caps={caps}"]
        if self.no_new_privs:
            argv.append("--no-new-privs")
        return [*argv, "--"]


# Every mount of the process's mount namespace read-only but the kernel's own file systems,
# as a read-only container root leaves only its volumes (mounted after this) writable.
READ_ONLY_ROOT = (
    "awk '{print $5}' /proc/self/mountinfo | sort -u | while read -r m; do "
    'case "$m" in /proc|/proc/*|/sys|/sys/*|/dev|/dev/*) ;; '
    '*) mount -o remount,bind,ro "$m" ;; esac; done'
)


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL if the test process dies, so nothing is left over."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def binaries() -> Path:
    """The built binaries, building them first if they are not cached (minutes, once)."""
    if os.geteuid() != 0:
        raise CannotRun("needs root (network and mount namespaces, /var/lib/kubelet)")
    for tool in ("unshare", "nsenter", "ip", "mount", "openssl", "kubectl"):
        if shutil.which(tool) is None:
            raise CannotRun(f"{tool} is not installed")
    done = subprocess.run(["bash", str(BUILD_SCRIPT), "bin"], capture_output=True, text=True)
    if done.returncode != 0:
        if os.environ.get("GPUPOOL_K8S_NO_BUILD") == "1":
            raise CannotRun(f"not built, and GPUPOOL_K8S_NO_BUILD=1 ({BUILD_SCRIPT} build)")
        done = subprocess.run(["bash", str(BUILD_SCRIPT), "build"], capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            raise CannotRun(f"could not build Kubernetes ({BUILD_SCRIPT} build):\n{tail}")
    out = Path(done.stdout.strip().splitlines()[-1])
    if shutil.which("etcd") is None:
        raise CannotRun("etcd is not installed (scripts/k8s-control-plane.sh install)")
    return out


@dataclass
class Process:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def make_certificates(pki: Path, ca_name: str, stem: str, common_name: str, sans: str) -> None:
    """A CA (`ca.crt`, `ca.key`) and a server certificate it signs (`<stem>.crt`,
    `<stem>.key`) for `sans` (openssl's subjectAltName list), valid one day, in `pki`."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=pki)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-keyout", "ca.key", "-out", "ca.crt", "-subj", f"/CN={ca_name}")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{stem}.key",
            "-out", f"{stem}.csr", "-subj", f"/CN={common_name}")  # fmt: skip
    (pki / "san.ext").write_text(f"subjectAltName={sans}\n")
    openssl("x509", "-req", "-in", f"{stem}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-extfile", "san.ext", "-out", f"{stem}.crt")  # fmt: skip


@dataclass
class ControlPlane:
    bin: Path
    work: Path
    chart_docs: list[dict[str, Any]] = field(default_factory=list)
    processes: dict[str, Process] = field(default_factory=dict)
    holder: subprocess.Popen[bytes] | None = None
    holder_pid: int = 0
    tokens: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, dict[str, bytes]] = field(default_factory=dict)
    made_dirs: list[Path] = field(default_factory=list)
    _ns_thread: ThreadPoolExecutor | None = None

    # ---- the namespace ------------------------------------------------------------------

    def enter_namespace(self) -> None:
        """Start the process that holds the network and mount namespaces."""
        hosts = self.work / "hosts"
        names = [
            "localhost",
            NODE,
            f"gpupool-k8s.{NAMESPACE}.svc",
            f"gpupool-controller.{NAMESPACE}.svc",
        ]
        hosts.write_text(f"127.0.0.1 {' '.join(names)}\n::1 localhost\n")
        mounts = [f"mount --bind {hosts} /etc/hosts"]
        for host_dir in HOST_DIRS:
            self._ensure_dir(Path(host_dir))
            mine = self.work / "host" / host_dir.strip("/").replace("/", "-")
            mine.mkdir(parents=True)
            mounts.append(f"mount --bind {mine} {host_dir}")
        script = "set -e; ip link set lo up; " + "; ".join(mounts) + "; echo $$; exec cat"
        self.holder = subprocess.Popen(
            [
                "unshare",
                "--net",
                "--mount",
                "--propagation",
                "private",
                "--fork",
                "sh",
                "-c",
                script,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )
        assert self.holder.stdout is not None
        line = self.holder.stdout.readline().decode().strip()
        if not line.isdigit():
            err = self.holder.stderr.read().decode() if self.holder.stderr else ""
            raise CannotRun(f"could not make the network namespace: {line} {err}".strip())
        self.holder_pid = int(line)
        self._ns_thread = ThreadPoolExecutor(1, "k8s-netns", initializer=self._join_netns)

    def _join_netns(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/proc/{self.holder_pid}/ns/net", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns into the test network namespace")
        finally:
            os.close(fd)

    def in_namespace(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn in a thread that joined the namespace: sockets it opens are in there."""
        assert self._ns_thread is not None
        return self._ns_thread.submit(fn, *args).result()

    def _ensure_dir(self, path: Path) -> None:
        missing = []
        probe = path
        while not probe.exists():
            missing.append(probe)
            probe = probe.parent
        path.mkdir(parents=True, exist_ok=True)
        self.made_dirs.extend(reversed(missing))

    def nsenter(self, *argv: str, wd: Path | None = None) -> list[str]:
        """argv in the namespaces, in `wd` (nsenter would start it in / otherwise: the
        kubelet's container cleanup deletes files in its working directory)."""
        where = wd or self.work / "cwd"
        where.mkdir(exist_ok=True)
        return [
            "nsenter",
            "-t",
            str(self.holder_pid),
            "--net",
            "--mount",
            f"--wd={where}",
            "--",
            *argv,
        ]

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        mounts: dict[str, Path] | None = None,
        cwd: Path | None = None,
        confinement: Confinement | None = None,
        read_only: Sequence[str] = (),
    ) -> Process:
        """Start a process in the namespace; `mounts` (path there -> path here) in its own,
        the `read_only` ones read-only; with a pod's `confinement`, as its container runs."""
        command = list(argv)
        mounts = dict(mounts or {})
        read_only_root = confinement is not None and confinement.read_only_root
        if confinement is not None:
            command = [*confinement.setpriv(), *command]
        if mounts or read_only_root:
            binds = [READ_ONLY_ROOT] if read_only_root else []
            sources = [str(source) for source in mounts.values()]

            def shadows(target: str) -> bool:  # a pod's /tmp hides this run's files
                return any(
                    src == target or src.startswith(target.rstrip("/") + "/") for src in sources
                )

            for target, source in sorted(mounts.items(), key=lambda m: shadows(m[0])):
                if source.is_dir():
                    self._ensure_dir(Path(target))
                binds.append(f"mount --bind {source} {target}")
                if read_only_root:  # a bind keeps its source's (now read-only) flags
                    mode = "ro" if target in read_only or target == SERVICE_ACCOUNT else "rw"
                    binds.append(f"mount -o remount,bind,{mode} {target}")
            if read_only_root:  # the image's working directory; nothing under it can change
                binds.append("cd /")
            script = "set -e; " + "; ".join(binds) + '; exec "$@"'
            unshare = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, name]
            command = unshare + command
        log = self.work / f"{name}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(
                self.nsenter(*command, wd=cwd or self._empty_dir(name)),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                preexec_fn=_die_with_parent,
            )
        process = Process(name, proc, log)
        self.processes[name] = process
        return process

    def _empty_dir(self, name: str) -> Path:
        directory = self.work / "cwd" / name
        directory.mkdir(parents=True, exist_ok=True)
        return directory

    def _volume(self, name: str) -> Path:
        """An emptyDir: the kubelet makes them 0777, for whichever user the pod runs as."""
        directory = self.work / "volumes" / name
        directory.mkdir(parents=True)
        directory.chmod(0o777)
        return directory

    def pod_mounts(
        self, key: str, pod: dict[str, Any], files: dict[str, Path]
    ) -> tuple[dict[str, Path], list[str]]:
        """A chart pod's volume mounts (path there -> directory here) and the read-only
        ones: emptyDirs made empty, Secrets as their files, the rest from `files` by volume
        name; its service account's token where the kubelet mounts it."""
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        mounts: dict[str, Path] = {}
        read_only = [SERVICE_ACCOUNT]
        if pod.get("automountServiceAccountToken", True):
            mounts[SERVICE_ACCOUNT] = self.service_account(key)
        for mount in pod["containers"][0].get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if mount["name"] in files:
                mounts[mount["mountPath"]] = files[mount["name"]]
            elif "emptyDir" in volume:
                mounts[mount["mountPath"]] = self._volume(f"{key}-{mount['name']}")
            elif "secret" in volume:
                mounts[mount["mountPath"]] = self.secret_dir(volume["secret"]["secretName"])
            else:
                raise AssertionError(f"{key}: no files for volume {mount['name']}: {volume}")
            if mount.get("readOnly"):
                read_only.append(mount["mountPath"])
        return mounts, read_only

    def run(
        self, *argv: str, timeout_s: float = 60.0, input_text: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.nsenter(*argv),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            input=input_text,
            env={**os.environ, "KUBECONFIG": str(self.kubeconfig("admin"))},
        )

    def kubectl(
        self,
        *args: str,
        check: bool = True,
        input_text: str | None = None,
        timeout_s: float = 180.0,
    ) -> subprocess.CompletedProcess[str]:
        done = self.run("kubectl", *args, input_text=input_text, timeout_s=timeout_s)
        if check and done.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)}: {done.stdout}\n{done.stderr}\n{self.logs()}"
            )
        return done

    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def gpupool(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            self.nsenter(sys.executable, "-m", "gpupool.cli", *args),
            capture_output=True,
            text=True,
            timeout=60,
            env={
                **os.environ,
                "GPUPOOL_URL": f"http://127.0.0.1:{CONTROLLER_PORT}",
                "GPUPOOL_TOKEN": self.admin_token,
            },
        )
        if check and done.returncode != 0:
            raise AssertionError(f"gpupool {' '.join(args)}: {done.stdout}\n{done.stderr}")
        return done

    @staticmethod
    def gpupool_argv() -> list[str]:
        return [sys.executable, "-m", "gpupool.cli"]

    def logs(self, lines: int = 25) -> str:
        return "\n".join(f"--- {p.name}\n{p.tail(lines)}" for p in self.processes.values())

    def wait_for(
        self,
        what: str,
        ready: Callable[[], bool],
        timeout_s: float = START_TIMEOUT_S,
        watch: Sequence[str] = (),
    ) -> None:
        """Poll `ready` until it holds; fail at once if a process in `watch` died."""
        deadline = time.monotonic() + timeout_s
        while True:
            for name in watch:
                process = self.processes[name]
                if not process.alive():
                    raise AssertionError(
                        f"{name} exited while waiting for {what}:\n{process.tail()}"
                    )
            if ready():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{self.logs()}")
            time.sleep(0.2)

    # ---- certificates, tokens, kubeconfigs ---------------------------------------------

    def make_pki(self) -> None:
        pki = self.work / "pki"
        pki.mkdir()
        make_certificates(
            pki, "k8s-test-ca", "apiserver", "kube-apiserver",
            "IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc",
        )  # fmt: skip

        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=pki)

        openssl("genrsa", "-out", "sa.key", "2048")
        openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub")
        rows = []
        for key, (user, groups) in TOKENS.items():
            token = base64.b32encode(os.urandom(20)).decode().lower()
            self.tokens[key] = token
            rows.append(f'{token},{user},uid-{key},"{groups}"')
        (pki / "tokens.csv").write_text("\n".join(rows) + "\n")
        for key in TOKENS:
            self._write_kubeconfig(key)

    def kubeconfig(self, key: str) -> Path:
        return self.work / "pki" / f"{key}.kubeconfig"

    def _write_kubeconfig(self, key: str) -> None:
        ca = base64.b64encode((self.work / "pki" / "ca.crt").read_bytes()).decode()
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "t",
                    "cluster": {
                        "server": f"https://127.0.0.1:{API_PORT}",
                        "certificate-authority-data": ca,
                    },
                }
            ],
            "users": [{"name": "u", "user": {"token": self.tokens[key]}}],
            "contexts": [{"name": "c", "context": {"cluster": "t", "user": "u"}}],
            "current-context": "c",
        }
        self.kubeconfig(key).write_text(yaml.safe_dump(config))

    def service_account(self, key: str) -> Path:
        """What a pod of this service account finds in /var/run/secrets/kubernetes.io/serviceaccount."""
        directory = self.work / "sa" / key
        if not directory.exists():
            directory.mkdir(parents=True)
            (directory / "token").write_text(self.tokens[key])
            shutil.copy(self.work / "pki" / "ca.crt", directory / "ca.crt")
            (directory / "namespace").write_text(NAMESPACE)
        return directory

    @property
    def admin_token(self) -> str:
        return self.secret("gpupool-admin-token")["token"].decode().strip()

    def chart_object(self, kind: str, name: str) -> dict[str, Any]:
        found = [d for d in self.chart_docs if d["kind"] == kind and d["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: {len(found)} in the rendered chart"
        return found[0]

    def secret(self, name: str) -> dict[str, bytes]:
        """A Secret's data as the API server holds it: the chart renders none, its
        init-secrets hook made them in the cluster (`helm_install`)."""
        if name not in self.secrets:
            secret = self.kubectl_json("-n", NAMESPACE, "get", "secret", name)
            data = secret.get("data") or {}
            self.secrets[name] = {k: base64.b64decode(v) for k, v in data.items()}
        return self.secrets[name]

    def secret_dir(self, name: str) -> Path:
        """A Secret of the cluster as the files a pod mounting it would see."""
        directory = self.work / "secrets" / name
        if not directory.exists():
            directory.mkdir(parents=True)
            for key, value in self.secret(name).items():
                (directory / key).write_bytes(value)
        return directory

    # ---- the processes ----------------------------------------------------------------

    def start_etcd(self) -> None:
        self.spawn(
            "etcd",
            [
                "etcd",
                "--name",
                "test",
                "--data-dir",
                str(self.work / "etcd"),
                "--listen-client-urls",
                "http://127.0.0.1:2379",
                "--advertise-client-urls",
                "http://127.0.0.1:2379",
                "--listen-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-advertise-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-cluster",
                "test=http://127.0.0.1:2380",
                "--listen-metrics-urls",
                "http://127.0.0.1:2381",
            ],
            env={"ETCD_UNSUPPORTED_ARCH": ""},
        )
        self.wait_for("etcd", lambda: self._http_ok("http://127.0.0.1:2379/health"), watch=["etcd"])

    def _webhook_admission_config(self) -> Path:
        """The API server's credentials for the webhook, as docs/kubernetes.md writes them."""
        doc = DOCS.read_text()
        block = next(
            b
            for b in re.findall(r"```yaml\n(.*?)```", doc, flags=re.S)
            if "AdmissionConfiguration" in b
        )
        admission, kubeconfig = list(yaml.safe_load_all(block))
        kubeconfig_path = self.work / "webhook-kubeconfig.yaml"
        plugin = admission["plugins"][0]["configuration"]
        plugin["kubeConfigFile"] = str(kubeconfig_path)
        # 1.20 serves WebhookAdmission as v1alpha1 only (v1 came with 1.21), as the doc says.
        plugin["apiVersion"] = "apiserver.config.k8s.io/v1alpha1"
        token = (self.secret_dir("gpupool-k8s-webhook-token") / "token").read_text().strip()
        kubeconfig["users"][0]["user"]["token"] = token
        kubeconfig_path.write_text(yaml.safe_dump(kubeconfig))
        admission_path = self.work / "admission.yaml"
        admission_path.write_text(yaml.safe_dump(admission))
        return admission_path

    def start_apiserver(self, webhook_credentials: bool = False) -> None:
        """kube-apiserver with TLS, static tokens, Node+RBAC and, once the chart's hook made
        the webhook's token, the webhook's credentials (the doc's AdmissionConfiguration)."""
        pki = self.work / "pki"
        admission = (
            [f"--admission-control-config-file={self._webhook_admission_config()}"]
            if webhook_credentials
            else []
        )
        self.spawn(
            "kube-apiserver",
            [
                str(self.bin / "kube-apiserver"),
                "--etcd-servers=http://127.0.0.1:2379",
                "--bind-address=127.0.0.1",
                f"--secure-port={API_PORT}",
                "--advertise-address=127.0.0.1",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--token-auth-file={pki / 'tokens.csv'}",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc",
                # Services get loopback addresses, which the namespace reaches: the API
                # server calls the webhook at its Service's cluster IP.
                "--service-cluster-ip-range=127.96.0.0/16",
                "--authorization-mode=Node,RBAC",
                # No controller-manager makes service-account tokens, and hand-made nodes would
                # stay tainted not-ready: both admission plugins off.
                "--disable-admission-plugins=ServiceAccount,TaintNodesByCondition",
                *admission,
            ],
        )
        self.wait_for(
            "kube-apiserver /readyz",
            lambda: self._http_ok(f"https://127.0.0.1:{API_PORT}/readyz", self.tokens["admin"]),
            watch=["kube-apiserver"],
        )

    def give_apiserver_the_webhook_token(self) -> None:
        """What docs/kubernetes.md asks of the operator after the install: the API server
        gets the Secret's token in its webhook kubeconfig, read at its start (a restart)."""
        self.secret("gpupool-k8s-webhook-token")  # read while the API server still runs
        apiserver = self.processes["kube-apiserver"].proc
        apiserver.terminate()
        apiserver.wait(timeout=30)
        self.start_apiserver(webhook_credentials=True)

    # ---- `helm install` ---------------------------------------------------------------

    def helm_install(self) -> None:
        """What `helm install -n gpupool` does with the rendered chart: its pre-install hooks
        applied in the order of their weights, the hook Job's command run (no
        controller-manager starts the Job's pod: its process runs here, as its service
        account), the hooks deleted once they succeeded (their delete policy), then the
        rest of the chart applied."""
        hooks = [d for d in self.chart_docs if HOOK in (d["metadata"].get("annotations") or {})]
        assert all("pre-install" in d["metadata"]["annotations"][HOOK] for d in hooks), hooks
        for weight in sorted({_hook_weight(d) for d in hooks}):
            apply_docs(self, [d for d in hooks if _hook_weight(d) == weight and d["kind"] != "Job"])
            for job in (d for d in hooks if _hook_weight(d) == weight and d["kind"] == "Job"):
                apply_docs(self, [job])
                self._run_hook_job(job)
        for doc in reversed(hooks):
            policy = doc["metadata"]["annotations"].get(f"{HOOK}-delete-policy", "")
            if "hook-succeeded" in policy:
                self.kubectl(
                    "-n", NAMESPACE, "delete", doc["kind"], doc["metadata"]["name"], "--wait=true"
                )
        apply_docs(self, [d for d in self.chart_docs if d not in hooks])

    def _run_hook_job(self, job: dict[str, Any]) -> None:
        """The Job's container command with its pod's service account, told where the API
        server is by flags (the pod would find it through KUBERNETES_SERVICE_HOST)."""
        spec = job["spec"]["template"]["spec"]
        assert spec["serviceAccountName"] == "gpupool-init-secrets", spec
        assert not spec.get("volumes"), "the hook's volumes are not mounted here"
        (container,) = spec["containers"]
        account = self.service_account("init-secrets")
        done = subprocess.run(
            self.nsenter(
                sys.executable,
                "-m",
                "gpupool.cli",
                *container["args"],
                f"--kube-api=https://127.0.0.1:{API_PORT}",
                f"--kube-token-file={account / 'token'}",
                f"--kube-ca-file={account / 'ca.crt'}",
            ),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"hook {job['metadata']['name']}: {done.stdout}{done.stderr}"
        assert done.stdout.startswith("created: "), done.stdout

    def wait_for_ca_bundle(self) -> None:
        """`k8s serve` sets its webhooks' caBundle at start: GPU pods wait for it."""
        ca = base64.b64encode(self.secret("gpupool-k8s-tls")["ca.crt"]).decode()

        def set_() -> bool:
            config = self.kubectl_json("get", "mutatingwebhookconfiguration", WEBHOOK_CONFIGURATION)
            return all(w["clientConfig"].get("caBundle") == ca for w in config["webhooks"])

        self.wait_for("the webhooks' caBundle", set_, watch=["k8s-serve"])

    def start_controller(self) -> None:
        """The controller as its pod runs it (user, read-only root, its volumes), on SQLite in
        its data volume where the chart's would use PostgreSQL, with the pool's packing
        policy: the node that already holds a slice is the pool's first choice."""
        pod = self.chart_object("Deployment", "gpupool-controller")["spec"]["template"]["spec"]
        container = pod["containers"][0]
        mounts, read_only = self.pod_mounts("controller", pod, {})
        data_dir = next(a for a in container["args"] if a.startswith("--data-dir="))
        self.spawn(
            "controller",
            [
                sys.executable,
                "-m",
                "gpupool.cli",
                "controller",
                "--host",
                "127.0.0.1",
                "--port",
                str(CONTROLLER_PORT),
                data_dir,
                "--policy",
                "packing",
            ],
            env={"GPUPOOL_ADMIN_TOKEN": self.admin_token},
            mounts=mounts,
            confinement=Confinement.of(pod, container),
            read_only=read_only,
        )
        self.wait_for(
            "the controller",
            lambda: self._http_ok(f"http://127.0.0.1:{CONTROLLER_PORT}/api/v1/health"),
            watch=["controller"],
        )

    def start_k8s_serve(self) -> None:
        """`gpupool k8s serve` with the arguments, Secrets, service account and security
        context of its pod."""
        deployment = self.chart_object("Deployment", "gpupool-k8s")
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        mounts, read_only = self.pod_mounts("extender", pod, {})
        self.spawn(
            "k8s-serve",
            [sys.executable, "-m", "gpupool.cli", *container["args"]],
            env={
                "GPUPOOL_TOKEN": self.admin_token,
                "KUBERNETES_SERVICE_HOST": "127.0.0.1",
                "KUBERNETES_SERVICE_PORT": str(API_PORT),
            },
            mounts=mounts,
            confinement=Confinement.of(pod, container),
            read_only=read_only,
        )
        port = next(p["containerPort"] for p in container["ports"])
        self.wait_for(
            "gpupool k8s serve",
            lambda: self._http_ok(f"https://127.0.0.1:{port}/healthz", verify=False),
            watch=["k8s-serve"],
        )

    def start_scheduler(self) -> None:
        """The chart's second scheduler with its own configuration (rendered for 1.20:
        v1beta1)."""
        config = self.chart_object("ConfigMap", "gpupool-scheduler-config")
        text = config["data"]["scheduler-config.yaml"]
        assert "apiVersion: kubescheduler.config.k8s.io/v1beta1\n" in text, text
        config_dir = self.work / "scheduler-config"
        config_dir.mkdir()
        (config_dir / "scheduler-config.yaml").write_text(text)
        deployment = self.chart_object("Deployment", "gpupool-scheduler")
        spec = deployment["spec"]["template"]["spec"]
        mounts, read_only = self.pod_mounts("scheduler", spec, {"config": config_dir})
        command = list(spec["containers"][0]["command"])
        self.spawn(
            "kube-scheduler",
            [str(self.bin / "kube-scheduler"), *command[1:], "--port=0"],
            env={"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(API_PORT)},
            mounts=mounts,
            confinement=Confinement.of(spec, spec["containers"][0]),
            read_only=read_only,
        )
        self.wait_for(
            "the gpupool scheduler's leader lease",
            lambda: (
                self.kubectl(
                    "-n", NAMESPACE, "get", "lease", "gpupool-scheduler", check=False
                ).returncode
                == 0
            ),
            watch=["kube-scheduler"],
        )

    def start_kubelet(self) -> None:
        """The fake CRI runtime, then the kubelet on it, from an empty working directory."""
        cri = self.work / "cri"
        cri.mkdir()
        endpoint = f"unix://{cri / 'fakecri.sock'}"
        self.spawn(
            "fakecri",
            [
                str(self.bin / "fakecri"),
                "-endpoint",
                endpoint,
                "-record-dir",
                str(self.containers_dir),
            ],
        )
        self.wait_for(
            "the fake CRI socket", lambda: (cri / "fakecri.sock").exists(), watch=["fakecri"]
        )
        sysctls = self.work / "sysctls"
        sysctls.mkdir()
        mounts: dict[str, Path] = {}
        for i, (path, value) in enumerate(KUBELET_SYSCTLS.items()):
            file = sysctls / str(i)
            file.write_text(value + "\n")
            mounts[path] = file
        config = self.work / "kubelet-config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubelet.config.k8s.io/v1beta1",
                    "kind": "KubeletConfiguration",
                    "address": "127.0.0.1",
                    "port": 10250,
                    "readOnlyPort": 0,
                    "healthzBindAddress": "127.0.0.1",
                    "healthzPort": 10248,
                    # Only the API server (on loopback, in this namespace) reaches it.
                    "authentication": {
                        "anonymous": {"enabled": True},
                        "webhook": {"enabled": False},
                    },
                    "authorization": {"mode": "AlwaysAllow"},
                    "cgroupsPerQOS": False,
                    "enforceNodeAllocatable": [],
                    "cgroupDriver": "cgroupfs",
                    "failSwapOn": False,
                    # A shared development disk may be fuller than the default thresholds.
                    "evictionHard": {
                        "memory.available": "1Mi",
                        "nodefs.available": "1%",
                        "imagefs.available": "1%",
                        "nodefs.inodesFree": "1%",
                    },
                    "imageGCHighThresholdPercent": 100,
                    "imageGCLowThresholdPercent": 99,
                    "syncFrequency": "2s",
                    "fileCheckFrequency": "2s",
                    "nodeStatusUpdateFrequency": "4s",
                    "serializeImagePulls": False,
                }
            )
        )
        cwd = self.work / "kubelet-cwd"
        cwd.mkdir()
        self.spawn(
            "kubelet",
            [
                str(self.bin / "kubelet"),
                f"--config={config}",
                f"--kubeconfig={self.kubeconfig('node')}",
                "--container-runtime=remote",
                f"--container-runtime-endpoint={endpoint}",
                f"--image-service-endpoint={endpoint}",
                f"--hostname-override={NODE}",
                "--node-ip=127.0.0.1",
                "--v=2",
            ],
            # Its legacy AWS credential provider asks the EC2 metadata address at start.
            env={"AWS_EC2_METADATA_DISABLED": "true"},
            mounts=mounts,
            cwd=cwd,
        )
        kubelet = self.processes["kubelet"].proc.pid
        # Its cleanup of simulated containers deletes files in its working directory.
        self.wait_for(
            "the kubelet to start",
            lambda: os.readlink(f"/proc/{kubelet}/exe").endswith("/kubelet"),
            watch=["kubelet"],
        )
        assert Path(os.readlink(f"/proc/{kubelet}/cwd")) == cwd, "kubelet not in its empty dir"
        self.wait_for(
            "the kubelet's node to be Ready", self._node_ready, watch=["kubelet", "fakecri"]
        )

    @property
    def containers_dir(self) -> Path:
        return self.work / "containers"

    def _node_ready(self) -> bool:
        done = self.kubectl("get", "node", NODE, "-o", "json", check=False)
        if done.returncode != 0:
            return False
        conditions = json.loads(done.stdout)["status"].get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def start_agent(self, fake: str = "2xH100-80GB", slots: int = 4) -> None:
        """An agent as the chart's DaemonSet runs it (root with three capabilities, a
        read-only root, its volumes: the kubelet's device-plugin directory, its data
        directory, /dev/shm, /run/gpupool, /tmp), on the simulated backend."""
        pod = self.chart_object("DaemonSet", "gpupool-agent")["spec"]["template"]["spec"]
        container = pod["containers"][0]
        args = dict(a.removeprefix("--").split("=", 1) for a in container["args"] if "=" in a)
        data = self.work / "agent"
        data.mkdir()
        (data / "shm").mkdir()
        kubelet_dir = self.work / "host" / "var-lib-kubelet" / "device-plugins"
        kubelet_dir.mkdir(parents=True, exist_ok=True)
        mounts, read_only = self.pod_mounts(
            "agent", pod, {"data": data, "device-plugins": kubelet_dir, "mps-shm": data / "shm"}
        )
        self.spawn(
            "agent",
            [
                sys.executable,
                "-m",
                "gpupool.cli",
                "agent",
                "--url",
                f"http://127.0.0.1:{CONTROLLER_PORT}",
                "--node",
                NODE,
                "--fake",
                fake,
                "--interval",
                "0.5",
                f"--data-dir={args['data-dir']}",
                "--no-banner",
                "--device-plugin",
                f"--kubelet-dir={args['kubelet-dir']}",
                "--vgpu-slots",
                str(slots),
                "--worker-user",
                "",
            ],
            # As the chart's agent pod: its service account lists the node's pods.
            env={
                "GPUPOOL_TOKEN": self.admin_token,
                "KUBERNETES_SERVICE_HOST": "127.0.0.1",
                "KUBERNETES_SERVICE_PORT": str(API_PORT),
            },
            mounts=mounts,
            confinement=Confinement.of(pod, container),
            read_only=read_only,
        )
        self.wait_for(
            "the node's gpupool.io/vgpu",
            lambda: self.allocatable("gpupool.io/vgpu") > 0,
            watch=["agent", "kubelet"],
        )

    def allocatable(self, resource: str, node: str = NODE) -> int:
        done = self.kubectl("get", "node", node, "-o", "json", check=False)
        if done.returncode != 0:
            return 0
        return int(json.loads(done.stdout)["status"].get("allocatable", {}).get(resource, "0"))

    def _http_ok(self, url: str, token: str | None = None, verify: bool | str = True) -> bool:
        import httpx

        def get() -> bool:
            ca: bool | ssl.SSLContext = bool(verify)
            if verify is True and url.startswith("https://"):
                ca = ssl.create_default_context(cafile=str(self.work / "pki" / "ca.crt"))
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            try:
                return httpx.get(url, headers=headers, verify=ca, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        return self.in_namespace(get)

    # ---- the end ----------------------------------------------------------------------

    def stop(self) -> None:
        for process in reversed(list(self.processes.values())):
            if process.alive():
                process.proc.terminate()
        for process in reversed(list(self.processes.values())):
            try:
                process.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.proc.kill()
                process.proc.wait()
        if self.holder is not None:
            with contextlib.suppress(OSError):
                assert self.holder.stdin is not None
                self.holder.stdin.close()
            try:
                self.holder.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.holder.kill()
                self.holder.wait()
        if self._ns_thread is not None:
            self._ns_thread.shutdown()
        shutil.rmtree(self.work, ignore_errors=True)
        for directory in reversed(self.made_dirs):
            with contextlib.suppress(OSError):
                directory.rmdir()


@contextlib.contextmanager
def control_plane(render: Callable[[], list[dict[str, Any]]]) -> Iterator[ControlPlane]:
    """The whole control plane, up and ready, the chart rendered by `render` and applied."""
    bin_dir = binaries()
    cp = ControlPlane(bin_dir, Path(tempfile.mkdtemp(prefix="gpupool-k8s-")))
    try:
        cp.enter_namespace()
        cp.containers_dir.mkdir()
        cp.chart_docs = render()
        cp.make_pki()
        cp.start_etcd()
        cp.start_apiserver()
        # 1.21+ labels every namespace with its name; 1.20 does not (the chart's webhook
        # namespaceSelector relies on the label).
        cp.kubectl("create", "namespace", NAMESPACE)
        for ns in ("default", "kube-system", "kube-public", "kube-node-lease", NAMESPACE):
            cp.kubectl("label", "namespace", ns, f"kubernetes.io/metadata.name={ns}", "--overwrite")
        cp.helm_install()
        cp.give_apiserver_the_webhook_token()
        cp.start_controller()
        cp.start_k8s_serve()
        cp.wait_for_ca_bundle()
        cp.start_scheduler()
        cp.start_kubelet()
        cp.start_agent()
        # As docs/kubernetes.md's install does: the examples' priorities (10, 100) are above
        # a new pool's default cap for its tenants (0).
        cp.gpupool("tenant", "set", "default", "--max-priority", "100")
        yield cp
    finally:
        cp.stop()


def _hook_weight(doc: dict[str, Any]) -> int:
    return int(doc["metadata"]["annotations"].get(f"{HOOK}-weight", "0"))


def apply_docs(cp: ControlPlane, docs: Sequence[dict[str, Any]]) -> None:
    """Rendered objects, applied with server-side apply (the API server validates them)."""
    placed = []
    for doc in docs:
        if doc["kind"] not in CLUSTER_SCOPED:  # what `helm install -n gpupool` does
            doc = {**doc, "metadata": {"namespace": NAMESPACE, **doc["metadata"]}}
        placed.append(doc)
    if placed:
        text = yaml.safe_dump_all(placed)
        cp.kubectl("apply", "--server-side", "--field-manager=helm", "-f", "-", input_text=text)
