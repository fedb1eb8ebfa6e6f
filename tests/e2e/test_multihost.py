"""Controller, two agents and a client on four hosts (network namespaces, real TCP between
them): the client leases GPUs of both agents' hosts and trains on them through workers."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from netpool import NetPool
from pool_checks import FaultRecord

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROGRAM = textwrap.dedent(
    """
    import json, torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model = model.to("cuda:0")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 8).cuda(), torch.randn(64, 1).cuda()
    losses = []
    for _ in range(10):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    other = (torch.ones(4, device="cuda:0").to("cuda:1") * 2).sum().item()
    print(json.dumps({"count": torch.cuda.device_count(), "first": losses[0],
                      "last": losses[-1], "other": other}))
    """
)


def test_client_trains_on_gpus_of_two_other_hosts_through_their_workers(
    netpool: NetPool, tmp_path: Path, record: FaultRecord
) -> None:
    record.fault = "none (multi-host baseline): a remote lease spanning two GPU hosts"
    record.setup = (
        "`gpupool run --remote --gpus 2` on the client host; one GPU on each agent's host"
    )
    netpool.start_controller()
    netpool.start_agent("gpu-a")
    netpool.start_agent("gpu-b")
    netpool.wait_nodes_up("gpu-a", "gpu-b")
    program = tmp_path / "train.py"
    program.write_text(PROGRAM)

    done = netpool.cli(
        "run", "--remote", "--gpus", "2", "--compute", "25%", "--memory", "1GiB", "--",
        sys.executable, str(program), timeout=240,
    )  # fmt: skip

    assert done.returncode == 0, done.stdout + done.stderr + netpool.logs()
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert result["count"] == 2 and result["other"] == 8.0
    assert result["last"] < result["first"]
    leases = netpool.call(lambda api: api.leases(state="all"))
    assert [lease.state for lease in leases] == ["released"]
    # The data plane crossed the bridge: one worker on each agent's host address.
    where = {
        (p.node, (p.endpoint or "").split("//")[-1].rsplit(":", 1)[0]) for p in leases[0].slices
    }
    assert where == {(name, host.address) for name, host in netpool.agents.items()}
    netpool.wait_for(
        "the workers to stop with their lease",
        lambda: not netpool.worker_pids("gpu-a") and not netpool.worker_pids("gpu-b"),
    )
    record.survived.append(
        "trained on cuda:0 and cuda:1, one worker on each GPU host over TCP; the lease was "
        "released and both workers stopped"
    )


def test_agent_on_a_host_cut_off_at_start_joins_once_the_link_is_up(
    netpool: NetPool, record: FaultRecord
) -> None:
    record.fault = "a GPU host without a link when its agent starts"
    record.setup = "agents on two hosts, one of them cut off until the other registered"
    netpool.start_controller()
    netpool.agents["gpu-b"].cut()
    netpool.start_agent("gpu-a")
    netpool.start_agent("gpu-b")
    netpool.wait_nodes_up("gpu-a")
    names = {n.name for n in netpool.call(lambda api: api.nodes())}
    assert names == {"gpu-a"}, "a host without a link cannot register"
    netpool.agents["gpu-b"].heal()
    netpool.wait_nodes_up("gpu-a", "gpu-b")
    record.survived.append("the cut-off agent kept retrying and registered once its link was up")
