"""DeepSpeed's ``--include`` / ``--exclude`` resource filters (``runner.parse_resource_filter``,
``runner.parse_inclusion_exclusion``): which slots of which hosts a run may use.

A filter is ``host[:slot,slot,...]`` entries joined by ``@``, e.g. ``worker-0:0,1@worker-1``; a
host without slots means all of its slots. ``host_info`` maps each host to its slot numbers.
deepspeed_cpp's launcher does not take these flags (it starts one node's processes through
torchrun), but scripts and tools that compute a DeepSpeed host list call these functions.
"""

from __future__ import annotations

from collections import OrderedDict


def _entries(filter_str: str, host_info: dict, flag: str) -> list[tuple[str, list[int] | None]]:
    entries = []
    for entry in filter_str.split("@"):
        host, _, slot_text = entry.partition(":")
        if host not in host_info:
            raise ValueError(
                f"{flag} {filter_str!r}: host {host!r} is not one of the hosts {sorted(host_info)}"
            )
        if not slot_text:
            entries.append((host, None))
            continue
        try:
            slots = [int(slot) for slot in slot_text.split(",")]
        except ValueError:
            raise ValueError(
                f"{flag} {filter_str!r}: slots {slot_text!r} of host {host!r} must be "
                "comma-separated integers"
            ) from None
        for slot in slots:
            if slot not in host_info[host]:
                raise ValueError(
                    f"{flag} {filter_str!r}: host {host!r} has no slot {slot} (its slots: "
                    f"{list(host_info[host])})"
                )
        entries.append((host, slots))
    return entries


def parse_resource_filter(host_info: dict, include_str: str = "", exclude_str: str = ""):
    """``host_info`` ({host: [slot, ...]}) narrowed by an include or an exclude filter (not
    both: ValueError), in ``host_info``'s host order with sorted slots; hosts left with no
    slot are dropped. Unknown hosts or slots raise ValueError naming them."""
    if include_str and exclude_str:
        raise ValueError(
            f"--include {include_str!r} and --exclude {exclude_str!r} exclude each other; "
            "pass one of them"
        )
    if not include_str and not exclude_str:
        return host_info
    if include_str:
        chosen: dict[str, set[int]] = {}
        for host, slots in _entries(include_str, host_info, "--include"):
            chosen.setdefault(host, set()).update(host_info[host] if slots is None else slots)
    else:
        chosen = {host: set(slots) for host, slots in host_info.items()}
        for host, slots in _entries(exclude_str, host_info, "--exclude"):
            chosen[host] -= set(host_info[host] if slots is None else slots)
    return OrderedDict((host, sorted(chosen[host])) for host in host_info if chosen.get(host))


def parse_inclusion_exclusion(resource_pool: dict, inclusion: str, exclusion: str):
    """``resource_pool`` ({host: slot count}) as {host: [0, ..., count - 1]}, filtered."""
    active = OrderedDict((host, list(range(slots))) for host, slots in resource_pool.items())
    return parse_resource_filter(active, include_str=inclusion, exclude_str=exclusion)
