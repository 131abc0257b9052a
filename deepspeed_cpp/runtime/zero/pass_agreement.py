"""How the ranks of a ZeRO-3 model agree that they run the same modules in the same order, so
that every rank's parameter gathers pair with the same gathers on the other ranks.

A gather is a collective: a rank that runs another module at the same point of a pass (a
data-dependent branch taken on some ranks only) would pair its gather with a peer's gather of
other parameters (silently wrong values when the sizes match, a gloo abort of the process when
they do not) or wait for a gather nobody issues. Each rank keeps the number and a digest of the
module uses since the last agreement. Two ways to agree on them:

- Checked (a recording pass, the first replay of a trace, the rest of a pass that left its plan):
  before the gathers decided at a use are launched, the ranks all-gather (unit about to be used,
  uses, digest): three integers per rank on a gloo group of their own. A pass costs one check
  per use that launches gathers, plus one at its end.
- Folded (a pass replaying a trace whose previous replay was checked): that checked replay
  recorded the plan, the byte size of every gather it issued, in order. Each gather of the pass
  carries a 40-byte header (deviated?, uses, digest, gather index, unit) after this rank's data,
  compared on every rank once it landed, before any parameter of it is used. A pass costs no
  check but the one at its end. A rank that leaves the plan (another unit than the trace's,
  gathers of another size, fewer gathers at the end of the pass) knows it locally; it then
  issues a stand-in of the plan's next gather (the peers' next gather, same size, so it pairs
  with it), its header marked deviated, or the end-of-pass check when no gather is left. If
  every rank left the plan at the same use the same way (the model's order changed everywhere),
  the stand-ins' headers agree and the pass goes on checked. Otherwise the headers differ on
  every rank: each waits for its gathers in flight, issues stand-ins for the plan's remaining
  gathers (so that no rank is left waiting for a peer's gather and the group ends clean) and
  raises ``RuntimeError`` naming the module each rank was at.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...comm.collective_errors import named_collective
from .shard_gather import all_gather_flat, gathers_by_exchange, launch_all_gather

END = -1  # the unit of a check at the end of a pass
HEADER_NUMEL = 5  # deviated, uses, digest, gather index, unit (int64 each)
_DIGEST_MODULUS = (1 << 61) - 1  # a prime: uses in another order give another digest


class PassAgreement:
    """One rank's side of the agreement (see the module docstring); the groups are None in a
    world of one, where nothing is agreed."""

    def __init__(self, world_size: int, check_group, fetch_group, unit_names: list[str]):
        self.world_size = world_size
        self.check_group = check_group
        self.fetch_group = fetch_group  # the gathers' group: stand-ins pair with them there
        self.unit_names = unit_names
        self.uses = 0  # uses since the last check, and their digest
        self.digest = 0
        self.plan: list[tuple[int, torch.device]] | None = None  # (bytes, device) per gather
        self._recording: list[tuple[int, torch.device]] | None = None
        self.folded = False  # this pass follows ``plan`` without checks
        self._next = 0  # index in ``plan`` of this pass's next gather
        self._in_flight: list = []  # folded gathers launched and not yet landed
        self.failed = False  # the ranks disagreed in this pass; every rank raised

    # --- uses and checks --------------------------------------------------------------------------
    def record_use(self, unit: int) -> None:
        self.uses += 1
        self.digest = (self.digest * 1_000_003 + unit + 2) % _DIGEST_MODULUS

    def start_check(self, unit: int):
        """Starts agreeing that every rank made the same uses since the last check and is about
        to use ``unit`` (``END``: ends the pass): a three-integers-per-rank all-gather;
        ``finish_check`` raises on every rank if not."""
        mine = torch.tensor([unit, self.uses, self.digest], dtype=torch.int64)
        self.uses = 0
        self.digest = 0
        if self.check_group is None:
            return None
        every = torch.empty(3 * self.world_size, dtype=torch.int64)
        return all_gather_flat(every, mine, self.check_group), every

    def finish_check(self, check) -> None:
        if check is None:
            return
        work, every = check
        with named_collective("all_gather of the ZeRO-3 unit check"):
            work.wait()
        rows = every.view(self.world_size, 3).tolist()
        if any(row != rows[0] for row in rows):
            self._fail()
            raise RuntimeError(self._message([row[0] for row in rows], []))

    # --- passes -----------------------------------------------------------------------------------
    def begin_pass(self, replaying: bool) -> None:
        """``replaying``: the fetch schedule replays a recorded trace in this pass."""
        self.failed = False
        self.folded = self.check_group is not None and replaying and self.plan is not None
        self._next = 0
        # A checked replay records the plan that the next passes fold their checks into.
        self._recording = [] if replaying and not self.folded else None

    def end_pass(self, diverged: bool) -> None:
        """The end-of-pass check (after a folded pass's gathers landed; a rank that issued
        fewer of them than the plan first stands in for the rest), and the plan for the next
        pass: the one recorded or followed in this pass, if it ran as traced."""
        if self.failed:  # every rank raised already: nothing more to pair
            self._fail()
            return
        self.land_in_flight()
        if self.folded and self._next < len(self.plan):
            self.deviate(END)
        followed = self.folded and self._next == len(self.plan)
        self.finish_check(self.start_check(END))
        if diverged:
            self.plan = None
        elif self._recording is not None:
            self.plan = self._recording
        elif not followed:
            self.plan = None
        self.folded = False
        self._recording = None

    def _fail(self) -> None:
        """The ranks disagreed (every rank raises): no plan, nothing in flight to compare,
        nothing counted; the next pass is checked (and the schedule records it afresh)."""
        self.failed = True
        self.plan = None
        self.folded = False
        self._recording = None
        self._in_flight.clear()
        self.uses = 0
        self.digest = 0

    # --- folded gathers ---------------------------------------------------------------------------
    def headers_for(self, layouts: list[tuple[int, torch.device]], unit: int):
        """The headers of the gathers about to be launched at a use of ``unit`` (one per
        ``(bytes, device)`` layout), or None to launch them without (checked: a replay records
        them into the plan). Leaves the plan first when they are not the plan's next gathers."""
        if self.folded and layouts != self.plan[self._next : self._next + len(layouts)]:
            self.deviate(unit)  # raises, or the pass goes on checked
        if not self.folded:
            if self._recording is not None:
                self._recording.extend(layouts)
            return None
        headers = []
        for _ in layouts:
            headers.append(self._header(deviated=False, unit=unit))
            self._next += 1
        return headers

    def launched(self, gather) -> None:
        self._in_flight.append(gather)

    def landed(self, gather, headers: torch.Tensor) -> None:
        """A folded gather arrived (``headers``: every rank's, one row each); raises on every
        rank if they differ."""
        if gather in self._in_flight:
            self._in_flight.remove(gather)
        rows = headers.tolist()
        if self.failed or all(row == rows[0] for row in rows):
            return
        self._disagree(rows)

    def land_in_flight(self) -> None:
        """Waits for every folded gather in flight, comparing headers (a follower learns of a
        peer's stand-in here at the latest)."""
        while self._in_flight:
            self._in_flight[0].finish()

    def deviate(self, unit: int) -> None:
        """This rank left the plan at a use of ``unit`` (``END``: ended the pass early): stands
        in for the peers' next gather, or the end-of-pass check when the plan has none left.
        Returns when every rank left it the same way (the pass goes on checked), else raises."""
        self.land_in_flight()
        if self._next == len(self.plan):
            self.folded = False
            self.finish_check(self.start_check(unit))
            return
        header = self._header(deviated=True, unit=unit)
        self._next += 1
        layout = self.plan[self._next - 1]
        works, gathered = _launch_stand_in(layout, header, self.fetch_group, self.world_size)
        with named_collective("all_gather of a ZeRO-3 stand-in gather (rank agreement)"):
            for work in works:
                work.wait()
        rows = read_headers(gathered, layout[0], self.world_size).tolist()
        if any(row != rows[0] for row in rows):
            self._disagree(rows)
        self.folded = False  # every rank left the plan here: the rest of the pass is checked

    def _header(self, *, deviated: bool, unit: int) -> torch.Tensor:
        return torch.tensor(
            [int(deviated), self.uses, self.digest, self._next, unit], dtype=torch.int64
        )

    def _disagree(self, rows: list[list[int]]) -> None:
        """Every rank issues the plan's gathers it has not issued yet (stand-ins), so that the
        gathers its peers issued or will issue before they learn of the disagreement pair
        with something, then raises."""
        self.failed = True
        self.land_in_flight()
        works = []
        while self._next < len(self.plan):
            header = self._header(deviated=True, unit=END)
            layout = self.plan[self._next]
            works.append(_launch_stand_in(layout, header, self.fetch_group, self.world_size))
            self._next += 1
        with named_collective("all_gather of ZeRO-3 stand-in gathers after a disagreement"):
            for stand_in, _ in works:
                for work in stand_in:
                    work.wait()
        self._fail()
        raise RuntimeError(self._message([row[4] for row in rows], [row[1] for row in rows]))

    def _message(self, units: list[int], uses: list[int]) -> str:
        def where(unit: int) -> str:
            return "end of the pass" if unit == END else repr(self.unit_names[unit])

        described = ", ".join(
            f"rank {r}: {where(u)}" + (f" (use {uses[r]} of the pass)" if uses else "")
            for r, u in enumerate(units)
        )
        return (
            f"ZeRO-3: the ranks ran different modules at the same point of a forward/backward "
            f"pass ({described}); every rank must run the modules that have partitioned "
            f"parameters in the same order, because their parameters are gathered collectively"
        )


def header_bytes() -> int:
    return HEADER_NUMEL * 8


def _launch_stand_in(layout: tuple[int, torch.device], header: torch.Tensor, group, world: int):
    """Starts a gather shaped like a planned one (``layout``: its data bytes and device; the
    same collectives as ``unit.py``'s), its data zeros and its header ``header``; returns (the
    collectives' works, every rank's gathered bytes)."""
    data_bytes, device = layout
    row = data_bytes + header_bytes()
    gathered = torch.zeros(row * world, dtype=torch.uint8, device=device)
    own = gathered.narrow(0, dist.get_rank(group) * row, row)
    own[data_bytes:].copy_(header.view(torch.uint8))
    works = launch_all_gather(gathered, own, group, by_exchange=gathers_by_exchange(group, device))
    return works, gathered


def read_headers(gathered: torch.Tensor, data_bytes: int, world: int) -> torch.Tensor:
    """Every rank's header from a folded gather's received bytes, one int64 row per rank."""
    rows = gathered.view(world, -1)[:, data_bytes:]
    return rows.cpu().contiguous().view(torch.int64)
