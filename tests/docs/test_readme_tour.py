"""The README's tour runs as written: every command of its block, in one shell, against a fresh
pool in a temporary home directory, each exiting 0 and printing what the README says it shows;
`gpupool down` at its end leaves no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.timing import scaled

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TOUR_MARK = "<!-- tests/docs/test_readme_tour.py runs this block"

# The machine the suite runs on may be loaded: the tour's time limit scales with the factor the
# suite is given.
SLOWDOWN = float(os.environ.get("GPUPOOL_TEST_SLOWDOWN", "1") or 1)
TOUR_TIMEOUT_S = 300 * SLOWDOWN  # 44 s at load 11, 84 s at load 18, on 2 cores

pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(TOUR_TIMEOUT_S) + 120)]


def tour_commands(readme: Path = README) -> list[str]:
    """The commands of the README's tour block: its lines, continuations joined, blank lines
    and whole-line comments left out. Each stays as written, trailing comment and all."""
    text = readme.read_text(encoding="utf-8")
    start = text.find(TOUR_MARK)
    assert start >= 0, f"README.md has no tour block marked {TOUR_MARK!r}"
    block = re.search(r"```bash\n(.*?)\n```", text[start:], re.S)
    assert block, "the tour's marker is not followed by a ```bash block"
    commands: list[str] = []
    pending = ""
    for line in block.group(1).splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.strip() and not line.lstrip().startswith("#"):
            commands.append(line.strip())
    return commands


@dataclass
class Pool:
    """What the checks need to know about the pool the tour starts."""

    port: int
    host: str


# What each command of the tour must print, beside exiting 0. Every command of the tour must
# match exactly one pattern here, so a command added to the README gets its check.
Check = Callable[[str, Pool], None]


def prints(*patterns: str) -> Check:
    def check(output: str, pool: Pool) -> None:
        for pattern in patterns:
            pattern = pattern.format(port=pool.port, host=re.escape(pool.host))
            assert re.search(pattern, output), f"expected {pattern!r} in:\n{output}"

    return check


def json_document(output: str, pool: Pool) -> None:
    json.loads(output)


def nothing(output: str, pool: Pool) -> None:
    pass


EXPECT: list[tuple[str, Check]] = [
    (r"^source \.venv/bin/activate\b", nothing),
    (r"^gpupool up --fake 4xH100-80GB --background\b", prints(r"127\.0\.0\.1:{port}")),
    (r"^cd\b", nothing),
    (r"^gpupool context\b", prints(r"127\.0\.0\.1:{port}")),
    (r"^gpupool nodes\b", prints(r"{host}", r"\bup\b")),
    (r"^gpupool gpus\b(?!.*-o json)", prints(*(f"GPU-sim-{{host}}-{i}" for i in range(4)))),
    (r"^LEASE=\$\(gpupool lease create --compute 25% --memory 20GiB -o json", nothing),
    (r"^gpupool lease show \$LEASE\b", prints(r"\bl-[0-9a-f]+", r"granted", r"25 ?%")),
    (r"^gpupool lease create --gpus 2 --physical --no-wait\b", prints(r"queued")),
    (r"^gpupool queue\b", prints(r"\bl-[0-9a-f]+", r"physical")),
    (r"^gpupool lease release \$LEASE\b", prints(r"released")),
    (r"^gpupool gpu mode \$\(hostname\):[01] physical --wait\b", prints(r"physical")),
    (r"^gpupool lease ls\b", prints(r"granted", r"{host}:0")),
    (r"^gpupool gpu isolate \$\(hostname\):3 --reason", prints(r"isolated")),
    (r"^gpupool gpu clear \$\(hostname\):3\b", prints(r"virtual")),
    (r"^gpupool tenant create team-a\b", prints(r"team-a")),
    (r"^gpupool lease create --tenant team-a\b", prints(r"granted", r"team-a")),
    (r"^gpupool events\b", prints(r"team-a", r"isolat")),
    (r"^gpupool pool -o json\b", json_document),
    (r"^gpupool down\b", nothing),
]


def check_for(command: str) -> Check:
    matches = [check for pattern, check in EXPECT if re.search(pattern, command)]
    assert len(matches) == 1, (
        f"the tour's command {command!r} matches {len(matches)} checks in "
        "tests/docs/test_readme_tour.py; give it exactly one"
    )
    return matches[0]


def cli_lacks_the_tours_commands() -> str | None:
    """Why the CLI cannot run the tour yet, or None: the tour needs `gpupool up --background`,
    `gpupool context` and `gpupool down`."""
    env = {**os.environ, "COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1"}
    gpupool = [sys.executable, "-m", "gpupool.cli"]
    top = subprocess.run([*gpupool, "--help"], capture_output=True, text=True, env=env)
    up = subprocess.run([*gpupool, "up", "--help"], capture_output=True, text=True, env=env)
    commands = set(re.findall(r"^\W*([a-z][a-z0-9-]*)\s{2,}", top.stdout, re.M))
    missing = [f"gpupool {c}" for c in ("context", "down") if c not in commands]
    if "--background" not in up.stdout:
        missing.append("gpupool up --background")
    if missing:
        return f"the CLI has no {', '.join(missing)} yet; the README's tour uses them"
    return None


def marked_processes(mark: str) -> list[int]:
    """Processes whose environment carries this test's mark: the pool the tour started."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if f"GPUPOOL_TOUR_MARK={mark}".encode() in (proc / "environ").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue  # gone, or not ours to read
    return pids


def end_processes(pids: list[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + scaled(10)
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.1)


@dataclass
class Tour:
    workdir: Path
    home: Path
    env: dict[str, str]
    mark: str
    port: int


@pytest.fixture
def tour(tmp_path: Path) -> Iterator[Tour]:
    """A working directory holding `.venv` (the interpreter running the tests, as
    `scripts/setup.sh` makes it), an empty home, and an environment without any GPUPOOL_
    setting: the CLI finds the pool only through what `gpupool up` records."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("the tour sources .venv/bin/activate: run the tests from a virtualenv")
    workdir, home = tmp_path / "checkout", tmp_path / "home"
    workdir.mkdir()
    home.mkdir()
    (workdir / ".venv").symlink_to(sys.prefix)
    mark = uuid.uuid4().hex
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GPUPOOL_") and k not in ("XDG_CONFIG_HOME", "VIRTUAL_ENV")
    }
    env.update(HOME=str(home), GPUPOOL_TOUR_MARK=mark, COLUMNS="200", NO_COLOR="1")
    yield Tour(workdir, home, env, mark, free_port())
    left = marked_processes(mark)
    if left:  # the tour failed before `gpupool down`, or down left these: end them
        subprocess.run(
            ["bash", "-c", "source .venv/bin/activate && gpupool down"],
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60 * SLOWDOWN,
            check=False,
        )
        end_processes(marked_processes(mark))


def run_in_one_shell(
    commands: list[str], tour: Tour, out: Path
) -> subprocess.CompletedProcess[str]:
    """Runs the commands in one bash, as a user pasting them would (variables and `cd` carry
    over), each with its output in out/N.out and its exit code in out/N.rc; the shell stops at
    the first command that fails. Output goes to files, not pipes: a pool started in the
    background must not hold the test's pipe open."""
    script: list[str] = []
    for n, command in enumerate(commands):
        script.append(f"{{ {command}\n}} >{out}/{n}.out 2>&1 </dev/null; rc=$?")
        script.append(f'echo $rc >{out}/{n}.rc; [ "$rc" = 0 ] || exit 100')
    (out / "tour.sh").write_text("\n".join(script) + "\n")
    with open(out / "shell.log", "w") as log:
        return subprocess.run(
            ["bash", str(out / "tour.sh")],
            cwd=tour.workdir,
            env=tour.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=TOUR_TIMEOUT_S,
            text=True,
            check=False,
        )


def as_run(command: str, port: int) -> str:
    """The command as the test runs it. Only `gpupool up` changes: it gets a free port, since
    other pools may hold 8900 on a shared machine; every later command must then find the pool
    through the context `gpupool up` recorded, not through the default URL."""
    return re.sub(r"^gpupool up ", f"gpupool up --port {port} ", command)


def test_the_tour_commands_are_read_from_the_readme() -> None:
    commands = tour_commands()
    assert commands[0] == "source .venv/bin/activate"
    assert commands[-1].startswith("gpupool down")
    for command in commands:
        check_for(command)


def test_the_readmes_tour_runs_as_written_against_a_fresh_pool(tour: Tour, tmp_path: Path) -> None:
    why = cli_lacks_the_tours_commands()
    if why:
        pytest.skip(why)
    commands = tour_commands()
    checks = [check_for(command) for command in commands]
    out = tmp_path / "out"
    out.mkdir()
    try:
        run_in_one_shell([as_run(c, tour.port) for c in commands], tour, out)
    except subprocess.TimeoutExpired:
        ran = [n for n in range(len(commands)) if (out / f"{n}.rc").exists()]
        stuck = len(ran)
        output = (out / f"{stuck}.out").read_text() if (out / f"{stuck}.out").exists() else ""
        pytest.fail(
            f"the tour did not finish in {TOUR_TIMEOUT_S:.0f} s; stuck at "
            f"{commands[stuck]!r}:\n{output}"
        )
    pool = Pool(port=tour.port, host=socket.gethostname())
    for n, (command, check) in enumerate(zip(commands, checks, strict=True)):
        assert (out / f"{n}.rc").exists(), (
            f"the tour stopped before {command!r}:\n{(out / 'shell.log').read_text()}"
        )
        output = (out / f"{n}.out").read_text(errors="replace")
        rc = int((out / f"{n}.rc").read_text())
        assert rc == 0, f"{command!r} exited {rc}:\n{output}"
        check(output, pool)
    left = marked_processes(tour.mark)
    assert not left, f"gpupool down left processes running: {left}"
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", tour.port)) != 0, (
            f"something still listens on the pool's port {tour.port} after gpupool down"
        )
