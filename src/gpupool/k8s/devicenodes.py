"""Which device files give a container a GPU: read from the NVIDIA driver's /proc and /dev.

The kubelet's Allocate answer may name device nodes (DeviceSpec) that the runtime creates in
the container, so a GPU pod gets its GPU's `/dev/nvidia<minor>` and the driver's control
nodes even where no NVIDIA runtime hook acts on NVIDIA_VISIBLE_DEVICES. A GPU's minor number
is not its index: the driver lists it, with the UUID, in
`/proc/driver/nvidia/gpus/<PCI bus id>/information`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

PROC_GPUS = Path("/proc/driver/nvidia/gpus")
DEV = Path("/dev")
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
"""What every CUDA process opens besides its GPU's node (the driver's control device, and
unified memory's)."""


@dataclass(frozen=True, slots=True)
class DeviceNodes:
    """The GPUs' minor numbers and the control nodes present on this host."""

    minors: dict[str, int] = field(default_factory=dict)
    """GPU UUID -> minor number: its node is /dev/nvidia<minor>."""
    control: tuple[str, ...] = ()
    """Paths of the control nodes that exist, e.g. /dev/nvidiactl."""
    dev: str = "/dev"

    def gpu_node(self, uuid: str) -> str | None:
        minor = self.minors.get(uuid)
        return None if minor is None else f"{self.dev}/nvidia{minor}"


def parse_information(text: str) -> tuple[str, int] | None:
    """(UUID, minor) from one GPU's `information` file; None when either is missing."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    uuid, minor = fields.get("GPU UUID", ""), fields.get("Device Minor", "")
    if not uuid.startswith("GPU-") or not minor.isdigit():
        return None
    return uuid, int(minor)


def discover(proc_gpus: Path = PROC_GPUS, dev: Path = DEV) -> DeviceNodes:
    """Read the driver's list of GPUs; device nodes that do not exist are left out."""
    minors: dict[str, int] = {}
    try:
        entries = sorted(proc_gpus.iterdir())
    except OSError:
        entries = []
    for entry in entries:
        try:
            found = parse_information((entry / "information").read_text(errors="replace"))
        except OSError:
            continue
        if found is not None and (dev / f"nvidia{found[1]}").exists():
            minors[found[0]] = found[1]
    control = tuple(str(dev / n) for n in CONTROL_NODES if (dev / n).exists())
    return DeviceNodes(minors=minors, control=control, dev=str(dev))


class DeviceNodeFinder:
    """`discover()` once, and again only when asked about a GPU it has not seen (a GPU
    added or reset while the agent runs), so the plugin's frequent views cost no I/O."""

    def __init__(self, proc_gpus: Path = PROC_GPUS, dev: Path = DEV) -> None:
        self.proc_gpus = proc_gpus
        self.dev = dev
        self._nodes: DeviceNodes | None = None

    def nodes_for(self, uuids: Iterable[str]) -> DeviceNodes:
        wanted = set(uuids)
        if self._nodes is None or not wanted <= self._nodes.minors.keys():
            self._nodes = discover(self.proc_gpus, self.dev)
            missing = wanted - self._nodes.minors.keys()
            if missing:
                log.warning(
                    "no device node found for GPU(s) %s under %s and %s",
                    ", ".join(sorted(missing)),
                    self.proc_gpus,
                    self.dev,
                )
        return self._nodes
