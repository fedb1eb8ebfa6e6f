"""What the CLI and the API say, in words a user knows: stated defaults, sizes in GiB, what an
isolation does to leases, deleted tenants' history, and no Python repr in any error."""

from __future__ import annotations

import re

import httpx
import pytest
from e2e_pool import Pool
from typer.testing import CliRunner

from gpupool.cli.main import app
from tests.conftest import AUTH

pytestmark = pytest.mark.slow

REPRS = re.compile(r"\bNone\b|Quota\(|object at 0x|<[a-zA-Z_.]+ object|Traceback|\w+Error\(")
"""What leaks from Python into a message: None, dataclass and object reprs, tracebacks."""


def test_a_memory_only_slice_gets_a_stated_proportional_compute_share(pool: Pool) -> None:
    done = pool.ok("lease", "create", "--memory", "1GiB", "-o", "json")
    assert "compute 2 %" in done.stderr, done.stderr
    assert "1GiB = 1 GiB" in done.stderr
    assert "kept 1 h (3600 s)" in done.stderr
    lease = __import__("json").loads(done.stdout)
    assert lease["slices"][0]["compute_pct"] == 2, "1 GiB of an 80 GiB GPU, rounded up"
    # The API does the same for a program that gives memory only.
    with httpx.Client(base_url=pool.url + "/api/v1", headers=AUTH, timeout=30) as api:
        made = api.post("/leases", json={"memory": "8Gi"})
        assert made.status_code == 201, made.text
        assert made.json()["slices"][0]["compute_pct"] == 10
        assert made.json()["ttl_s"] == 30, "programs heartbeat: the controller's 30 s"


def test_decimal_and_binary_sizes_are_told_apart_and_said_back(pool: Pool) -> None:
    decimal = pool.ok("lease", "create", "--compute", "30%", "--memory", "20GB")
    assert "memory 20GB = 18.6 GiB" in decimal.stderr
    binary = pool.json("lease", "create", "--compute", "30%", "--memory", "20Gi")
    assert binary["slices"][0]["memory_mib"] == 20 * 1024
    ambiguous = pool.cli("lease", "create", "--memory", "512m")
    assert ambiguous.returncode == 2 and "ambiguous" in ambiguous.stderr


def test_isolating_a_gpu_says_its_direct_lease_keeps_running(pool: Pool) -> None:
    lease = pool.json("lease", "create", "--compute", "10%", "--memory", "1Gi")
    gpu = lease["slices"][0]["gpu_uuid"]
    said = pool.ok("gpu", "isolate", gpu).stdout
    assert "takes no new leases" in said
    assert f"1 direct lease(s) keep running on it until released ({lease['id']}" in said
    assert pool.lease(lease["id"])["state"] in ("granted", "active")
    idle = next(g["uuid"] for g in pool.json("gpus") if g["uuid"] != gpu)
    assert "No lease was on it." in pool.ok("gpu", "isolate", idle).stdout


def test_a_tenant_with_history_is_deleted_and_its_history_kept(pool: Pool) -> None:
    pool.ok("tenant", "create", "team")
    lease = pool.json("lease", "create", "--tenant", "team", "--compute", "10%", "-m", "1Gi")
    refused = pool.cli("tenant", "delete", "team")
    assert refused.returncode == 2 and "release them first" in refused.stderr
    pool.ok("lease", "release", lease["id"])
    assert "deleted tenant team" in pool.ok("tenant", "delete", "team").stdout
    assert "team" not in [t["name"] for t in pool.json("tenant", "ls")]
    assert pool.cli("tenant", "show", "team").returncode == 2
    history = pool.json("lease", "ls", "--all", "--tenant", "team")
    assert [item["id"] for item in history] == [lease["id"]]
    kinds = [e["kind"] for e in pool.json("events") if e["subject"] == "team"]
    assert kinds[-1] == "tenant.deleted"
    gone = pool.cli("lease", "create", "--tenant", "team", "--compute", "10%")
    assert gone.returncode == 2 and "no tenant 'team'" in gone.stderr
    again = pool.json("tenant", "create", "team", "--max-gpus", "1")
    assert again["max_gpus"] == 1
    assert pool.json("lease", "ls", "--all", "--tenant", "team")[0]["id"] == lease["id"]


BAD_CLI = [
    ["lease", "show", "x" * 120_000],
    ["lease", "show", "l-000000000000"],
    ["lease", "release", "nosuch"],
    ["lease", "renew", "nosuch"],
    ["lease", "create", "--memory", "lots"],
    ["lease", "create", "--memory", "-5Gi"],
    ["lease", "create", "--memory", "9" * 5000 + "Gi"],
    ["lease", "create", "--memory", "100Ti"],
    ["lease", "create", "--compute", "500%"],
    ["lease", "create", "--holder", "h" * 300],
    ["lease", "create", "--tenant", "nosuch", "--compute", "10%"],
    ["lease", "create", "--gpus", "9", "--compute", "10%"],
    ["lease", "create", "--node", "nosuch", "--compute", "10%"],
    ["lease", "create", "--physical", "--memory", "1Gi"],
    ["lease", "create", "--ttl", "-1"],
    ["lease", "resize", "nosuch", "--memory", "1Gi"],
    ["lease", "migrate", "nosuch"],
    ["gpu", "show", "nosuch"],
    ["gpu", "isolate", "y" * 5000],
    ["gpu", "mode", "nosuch", "physical"],
    ["node", "show", "nosuch"],
    ["tenant", "show", "nosuch"],
    ["tenant", "delete", "nosuch"],
    ["tenant", "delete", "default"],
    ["tenant", "create", "t" * 65],
    ["tenant", "create", "q", "--max-memory", "12"],
    ["tenant", "set", "nosuch", "--max-gpus", "1"],
    ["token", "revoke", "nosuch"],
    ["context", "use", "nosuch"],
    ["context", "use", "c" * 100_000],
    ["down", "--context", "nosuch"],
    ["events", "--limit", "0"],
]


def test_bad_cli_input_gets_one_line_in_words_and_a_non_zero_exit(pool: Pool) -> None:
    """One pool for every input, the CLI run in this process (as `gpupool` runs it, less the
    interpreter's start, which would make this test minutes long on a loaded machine)."""
    wrong = []
    for args in BAD_CLI:
        done = CliRunner().invoke(app, ["--url", pool.url, *args])
        lines = done.stderr.strip().splitlines()
        shown = " ".join(a[:20] for a in args)
        if done.exit_code == 0:
            wrong.append(f"{shown}: exit 0")
        elif len(lines) != 1 or not lines[0].startswith("error: "):
            wrong.append(f"{shown}: {len(lines)} lines: {done.stderr[:300]}")
        elif REPRS.search(lines[0]) or len(lines[0]) > 400:
            wrong.append(f"{shown}: {lines[0][:400]}")
    assert not wrong, "\n".join(wrong)


BAD_API = [
    ("POST", "/leases", {"memory": "lots"}),
    ("POST", "/leases", {"memory": "512m"}),
    ("POST", "/leases", {"compute_pct": 0}),
    ("POST", "/leases", {"gpus": 99, "compute_pct": 10}),
    ("POST", "/leases", {"tenant": "nosuch", "compute_pct": 10}),
    ("POST", "/leases", {"holder": "h" * 300}),
    ("POST", "/leases", {"physical": True, "memory": "1Gi"}),
    ("POST", "/leases", {"memory": "1Gi", "access": "remote", "cpu": "2"}),
    ("POST", "/tenants", {"name": "q", "quota": {"max_memory": "12"}}),
    ("POST", "/tenants", {"name": "dup", "quota": {"max_gpus": 1}}),
    ("GET", "/leases/nosuch", None),
    ("GET", "/tenants/nosuch", None),
    ("DELETE", "/tenants/default", None),
    ("PATCH", "/tenants/nosuch", {"weight": 2}),
    ("GET", "/gpus/nosuch", None),
]


def test_bad_api_requests_get_4xx_with_a_reason_in_words(pool: Pool) -> None:
    with httpx.Client(base_url=pool.url + "/api/v1", headers=AUTH, timeout=30) as api:
        assert api.post("/tenants", json={"name": "dup"}).status_code == 201
        for method, path, body in BAD_API:
            answer = api.request(method, path, json=body)
            assert 400 <= answer.status_code < 500, (method, path, answer.text)
            detail = str(answer.json().get("detail"))
            assert detail and not REPRS.search(detail), (method, path, detail)
