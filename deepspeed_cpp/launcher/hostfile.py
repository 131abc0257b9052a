"""DeepSpeed hostfiles (``hostname slots=N`` per line), read so the launcher can say what they ask.

DeepSpeed's own launcher ssh-es into every host of the hostfile. Ours never starts remote
processes: torchrun runs on each node and meets the others at ``--master_addr``. The hostfile is
therefore information: the launcher prints the hosts and the command each of them must run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_HOST_LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\d+)$")


class HostfileError(ValueError):
    """A hostfile that cannot be read or has a malformed line."""


@dataclass(frozen=True)
class HostSlots:
    """One hostfile entry: a host and how many processes (slots) it offers."""

    host: str
    slots: int


def read_hostfile(path: str | Path) -> list[HostSlots]:
    """The hosts of a DeepSpeed hostfile, in file order (see ``parse_hostfile_lines``); a file
    that cannot be read raises ``HostfileError`` naming it."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise HostfileError(f"--hostfile {str(path)!r} cannot be read: {error.strerror}") from None
    return parse_hostfile_lines(text.splitlines(), f"--hostfile {str(path)!r}")


def parse_hostfile_lines(lines, source: str = "hostfile") -> list[HostSlots]:
    """The hosts of hostfile ``lines``, in order. Blank lines and ``#`` comments are skipped. A
    line that is not ``hostname slots=N``, zero slots or a repeated host raise
    ``HostfileError`` (a ValueError) naming ``source`` and the line."""
    hosts: list[HostSlots] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOST_LINE.match(line)
        where = f"{source} line {number}"
        if match is None:
            raise HostfileError(f"{where} is {raw!r}; expected 'hostname slots=N'")
        host, slots = match["host"], int(match["slots"])
        if slots < 1:
            raise HostfileError(f"{where}: slots={slots} for {host!r}; expected at least 1")
        if host in seen:
            raise HostfileError(f"{where}: host {host!r} already listed on line {seen[host]}")
        seen[host] = number
        hosts.append(HostSlots(host, slots))
    if not hosts:
        raise HostfileError(f"{source} lists no hosts")
    return hosts


def describe_hostfile(
    path: str | Path, hosts: list[HostSlots], num_nodes: int, procs_per_node: int, master_port: int
) -> list[str]:
    """Lines telling the user what the hostfile asks for and how to run it with torchrun."""
    listed = ", ".join(f"{h.host} (slots={h.slots})" for h in hosts)
    lines = [f"hostfile {str(path)!r}: {len(hosts)} host(s): {listed}"]
    lines.append(
        "this launcher starts only this node's processes (through torchrun); run it on every "
        f"host with --num_nodes {len(hosts)} --node_rank <0..{len(hosts) - 1}> "
        f"--master_addr {hosts[0].host} --master_port {master_port}"
    )
    if num_nodes != len(hosts):
        lines.append(f"note: --num_nodes is {num_nodes} but the hostfile lists {len(hosts)} hosts")
    uneven = sorted({h.slots for h in hosts} - {procs_per_node})
    if uneven:
        lines.append(
            f"note: {procs_per_node} process(es) per node will be started, but the hostfile "
            f"offers slots={uneven} on some hosts (torchrun starts the same number on each node)"
        )
    return lines
