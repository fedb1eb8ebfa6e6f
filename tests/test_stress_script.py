"""scripts/stress.sh: the burners run while the command runs and are gone when it ends."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.timing import scaled

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "stress.sh"
# The command lists its siblings: the burners and the load sampler, children of stress.sh.
SIBLINGS = "ps -o pid=,args= --ppid $PPID; exit 3"


def _stress(*command: str, burners: str = "2") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPUPOOL_STRESS_BURNERS": burners}
    return subprocess.run(
        ["bash", str(SCRIPT), *command], capture_output=True, text=True, env=env, timeout=scaled(60)
    )


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_the_burners_run_with_the_command_and_stop_with_it() -> None:
    done = _stress("sh", "-c", SIBLINGS)
    assert done.returncode == 3, done.stderr  # the command's own exit status
    burners = [int(line.split()[0]) for line in done.stdout.splitlines() if "while :" in line]
    assert len(burners) == 2, done.stdout
    assert not [pid for pid in burners if _alive(pid)]
    assert "stress: exit 3 after" in done.stderr


def test_a_bad_burner_count_or_no_command_is_refused_in_one_line() -> None:
    bad = _stress("true", burners="eight")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "GPUPOOL_STRESS_BURNERS=eight is not a whole number"
    empty = _stress()
    assert empty.returncode == 2
    assert empty.stderr.startswith("usage:")
