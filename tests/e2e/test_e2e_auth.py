"""Tokens from the CLI, agents that need one, and the API over TLS, with real processes."""

from __future__ import annotations

import os
import ssl
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from e2e_pool import FAKE_SPEC, Pool, free_port, gpupool_argv, stop

from tests.timing import scaled


def run_as(pool: Pool, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GPUPOOL_URL", "GPUPOOL_TOKEN")}
    return subprocess.run(
        gpupool_argv("--url", pool.url, "--token", token, *args),
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_tokens_from_the_cli_and_a_tenant_acting_with_one(pool: Pool) -> None:
    pool.ok("tenant", "create", "ml")
    made = pool.ok("token", "create", "alice", "--role", "tenant", "--tenant", "ml")
    token = made.stdout.strip()
    assert token.startswith("gpp_") and "shown once" in made.stderr
    me = run_as(pool, token, "whoami")
    assert me.returncode == 0 and "alice (tenant, tenant ml)" in me.stdout

    lease = run_as(pool, token, "lease", "create", "-c", "10%", "-m", "1GiB", "-o", "json")
    assert lease.returncode == 0, lease.stderr
    denied = run_as(pool, token, "gpu", "drain", pool.json("gpus")[0]["uuid"])
    assert denied.returncode != 0
    assert len(denied.stderr.strip().splitlines()) == 1 and "tenant token" in denied.stderr

    [row] = [t for t in pool.json("token", "ls") if t["name"] == "alice"]
    pool.ok("token", "revoke", row["id"])
    after = run_as(pool, token, "whoami")
    assert after.returncode != 0 and "not valid" in after.stderr
    assert any(t["revoked_at"] for t in pool.json("token", "ls", "--all") if t["name"] == "alice")


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (("token", "create", "x", "--role", "root"), "--role must be one of"),
        (("token", "create", "x", "--role", "tenant"), "needs --tenant"),
        (("token", "create", "x", "--role", "viewer", "--expires", "soon"), "--expires"),
    ],
)
def test_bad_token_commands_fail_in_one_line(pool: Pool, args: tuple[str, ...], reason: str) -> None:
    done = pool.cli(*args)
    assert done.returncode == 2 and reason in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_an_agent_without_a_token_is_refused_before_it_starts(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GPUPOOL_TOKEN"}
    env["HOME"] = str(tmp_path)  # no ~/.config/gpupool/token
    done = subprocess.run(
        gpupool_argv("agent", "--url", "http://127.0.0.1:9", "--fake", FAKE_SPEC),
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 2 and "needs an API token" in done.stderr


def test_token_new_prints_a_token_a_controller_accepts_as_admin(tmp_path: Path) -> None:
    token = subprocess.run(
        gpupool_argv("token", "new"), capture_output=True, text=True, check=True
    ).stdout.strip()
    port = free_port()
    env = {**os.environ, "GPUPOOL_ADMIN_TOKEN": token}
    log = (tmp_path / "ctl.log").open("wb")
    ctl = subprocess.Popen(
        gpupool_argv("controller", "--port", str(port), "--data-dir", str(tmp_path / "d")),
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}/api/v1"
        _wait(lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200, ctl)
        me = httpx.get(f"{url}/whoami", headers={"Authorization": f"Bearer {token}"}).json()
        assert me["role"] == "admin"
        assert not (tmp_path / "d" / "admin.token").exists()  # it was given: nothing written
    finally:
        stop(ctl)
        log.close()


def _wait(check: object, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the process exited"
        try:
            if check():  # type: ignore[operator]
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("timed out")


def _self_signed(where: Path) -> tuple[Path, Path]:
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.mark.skipif(not Path("/usr/bin/openssl").exists(), reason="openssl is not installed")
def test_the_api_and_an_agent_over_tls(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    log = (tmp_path / "ctl.log").open("wb")
    ctl = subprocess.Popen(
        gpupool_argv(
            "controller", "--port", str(port), "--data-dir", str(tmp_path / "d"),
            "--tls-cert", str(cert), "--tls-key", str(key),
        ),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    agent: subprocess.Popen[bytes] | None = None
    env = {**os.environ, "GPUPOOL_CA": str(cert)}
    try:
        _wait(
            lambda: httpx.get(f"{url}/api/v1/health", verify=ssl.create_default_context(cafile=str(cert)), timeout=1).is_success, ctl
        )
        # Plain HTTP to the TLS port gets no API.
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/api/v1/health", timeout=2).raise_for_status()
        # A client that does not trust the certificate is told so, in one line.
        untrusted = subprocess.run(
            gpupool_argv("--url", url, "gpus"), capture_output=True, text=True, timeout=60
        )
        assert untrusted.returncode != 0 and "certificate" in untrusted.stderr.lower()
        agent_log = (tmp_path / "agent.log").open("wb")
        agent = subprocess.Popen(
            gpupool_argv(
                "agent", "--url", url, "--fake", FAKE_SPEC, "--interval", "0.3",
                "--data-dir", str(tmp_path / "agent"),
            ),
            env=env,
            stdout=agent_log,
            stderr=subprocess.STDOUT,
        )

        def gpus() -> list[object]:
            done = subprocess.run(
                gpupool_argv("--url", url, "gpus", "-o", "json"),
                capture_output=True,
                text=True,
                timeout=60,
                env=env,
            )
            return [] if done.returncode else list(__import__("json").loads(done.stdout))

        deadline = time.monotonic() + scaled(60)
        while not gpus():
            assert agent.poll() is None and time.monotonic() < deadline, "agent over TLS"
            time.sleep(0.3)
    finally:
        if agent is not None:
            stop(agent)
        stop(ctl)
        log.close()


def _agent_with_join_token(pool: Pool, join: str, node: str, data_dir: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "GPUPOOL_TOKEN"}
    env["GPUPOOL_JOIN_TOKEN"] = join
    env["HOME"] = str(data_dir)  # no ~/.config/gpupool/token to fall back on
    with (pool.workdir / f"agent-{node}.log").open("ab") as log:
        return subprocess.Popen(
            gpupool_argv(
                "agent", "--url", pool.url, "--node", node, "--fake", "1xH100-80GB",
                "--interval", "0.3", "--data-dir", str(data_dir),
            ),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=data_dir,
        )  # fmt: skip


def test_an_agent_joins_with_a_join_token_once_and_keeps_its_node_token(
    pool: Pool, tmp_path: Path
) -> None:
    """The DaemonSet case, with real processes: agents share one join token; each trades it
    for a token of its own node, kept owner-only, and a restart does not join again."""
    join = pool.ok("token", "create", "rack", "--role", "join", "--max-nodes", "1").stdout.strip()
    data = tmp_path / "gpu-7"
    data.mkdir()
    agent = _agent_with_join_token(pool, join, "gpu-7", data)
    try:
        pool.wait_for("gpu-7 to register", lambda: any(n["name"] == "gpu-7" for n in pool.json("nodes")))
        kept = data / "node.token"
        assert kept.stat().st_mode & 0o777 == 0o600
        me = httpx.get(
            f"{pool.url}/api/v1/whoami",
            headers={"Authorization": f"Bearer {kept.read_text().strip()}"},
        ).json()
        assert me["role"] == "agent" and me["node"] == "gpu-7"
        stop(agent)
        agent = _agent_with_join_token(pool, join, "gpu-7", data)  # the join token is spent
        before = len(pool.json("events", "--kind", "node.reregistered"))
        pool.wait_for(
            "gpu-7 to register again",
            lambda: len(pool.json("events", "--kind", "node.reregistered")) > before,
        )
        agents = [t for t in pool.json("token", "ls") if t["role"] == "agent"]
        assert [t["node"] for t in agents] == ["gpu-7"]
    finally:
        stop(agent)
    # A second node cannot use the spent join token, and is told why.
    other = tmp_path / "gpu-8"
    other.mkdir()
    rogue = _agent_with_join_token(pool, join, "gpu-8", other)
    try:
        log = pool.workdir / "agent-gpu-8.log"
        pool.wait_for("the refusal", lambda: "joined all the nodes it may" in log.read_text())
        assert not any(n["name"] == "gpu-8" for n in pool.json("nodes"))
        assert not (other / "node.token").exists()
    finally:
        stop(rogue)


def test_token_create_for_a_node_and_its_bad_forms_from_the_cli(pool: Pool) -> None:
    made = pool.ok("token", "create", "gpu-7", "--role", "agent", "--node", "gpu-7")
    assert "for node gpu-7" in made.stderr
    for args, reason in (
        (("--role", "agent"), "acts for one node: give --node"),
        (("--role", "viewer", "--node", "gpu-7"), "only an agent token names a node"),
        (("--role", "agent", "--node", "a/b"), "--node must be"),
        (("--role", "agent", "--node", "n", "--max-nodes", "2"), "only a join token"),
        (("--role", "join", "--max-nodes", "0"), "--max-nodes must be"),
    ):
        done = pool.cli("token", "create", "x", *args)
        assert done.returncode == 2 and reason in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
