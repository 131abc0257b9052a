"""csrc/zero/fetch_schedule: ZeRO-3 gather/release decisions on recorded traces, no process group.

The schedule is driven like the coordinator drives it: per module ``on_use`` (gather what it
returns) then ``on_done`` (release on True); backward runs the modules in reverse order.
"""

from __future__ import annotations

import random

import pytest

from deepspeed_cpp.ops.zero import make_fetch_schedule

NUMEL = [10, 20, 30, 40]
CHAIN = [0, 1, 2, 3]  # one module per unit; trace of a training pass: 0 1 2 3 3 2 1 0


def module_events(units):
    """One module call: its units used (nested when a module needs several), then done."""
    return [("use", u) for u in units] + [("done", u) for u in reversed(units)]


def pass_events(modules, backward=True):
    events = []
    for module in modules:
        events += module_events(module)
    if backward:
        for module in reversed(modules):
            events += module_events(module)
    return events


def chain(units, backward=True):
    return pass_events([(u,) for u in units], backward)


def drive(sched, events):
    """Runs one pass: on_use's lists and on_done's answers in call order, then end_pass's."""
    results = []
    for kind, unit in events:
        results.append(sched.on_use(unit) if kind == "use" else sched.on_done(unit))
    results.append(("end", sched.end_pass()))
    return results


def schedule(numel=NUMEL, *, bucket, live=10**9, reuse=0):
    return make_fetch_schedule(
        numel, prefetch_bucket_size=bucket, max_live_parameters=live, max_reuse_distance=reuse
    )


def test_recording_pass_returns_only_demanded_units():
    sched = schedule(bucket=1000, reuse=10**9)
    assert sched.recording() and sched.num_units() == 4
    got = drive(sched, chain(CHAIN))
    # Recording keeps nothing (no trace to measure reuse on) and prefetches nothing.
    expected = []
    for u in CHAIN + CHAIN[::-1]:
        expected += [[u], True]
    assert got == expected + [("end", [])]
    assert not sched.recording() and sched.trace() == [0, 1, 2, 3, 3, 2, 1, 0]
    assert sched.divergences() == 0 and sched.peak_live_numel() == 40


def test_replay_prefetch_window_cuts_at_bucket_size():
    sched = schedule(bucket=50)
    drive(sched, chain(CHAIN))
    got = drive(sched, chain(CHAIN))
    # use 0: window takes 1 (20) and 2 (20+30 = 50, exactly the bucket), stops at 3 (90).
    # use 2: ahead is 0 again, takes 3 (40) and stops at 1 (60); use 3: takes 2, 1 (50), not 0.
    # done 3 in forward: its next use is the next entry (distance 0 <= 0): kept.
    # use 2 in backward: ahead holds 1 (20); 0 brings it to 30.
    assert got == [
        [0, 1, 2], True,
        [], True,
        [3], True,
        [2, 1], False,
        [], True,
        [0], True,
        [], True,
        [], True,
        ("end", []),
    ]  # fmt: skip
    assert sched.divergences() == 0 and not sched.recording()


def test_max_live_cuts_prefetch_but_demand_goes_over_budget():
    sched = schedule(bucket=1000, live=30)
    drive(sched, chain(CHAIN))
    sched.reset_peak()
    got = drive(sched, chain(CHAIN))
    # use 0: 10 + 20 = 30 fits, + 30 does not. Unit 3 (40) alone exceeds the budget: fetched
    # anyway when demanded, and nothing else is prefetched while over; not kept for its reuse
    # right after either (that would stay over the budget).
    assert got == [
        [0, 1], True,
        [], True,
        [2], True,
        [3], True,
        [3], True,
        [2], True,
        [1, 0], True,
        [], True,
        ("end", []),
    ]  # fmt: skip
    assert sched.peak_live_numel() == 40


def test_prefetch_zero_is_on_demand():
    sched = schedule([0, 5, 0, 7], bucket=0)
    drive(sched, chain(CHAIN))
    got = drive(sched, chain(CHAIN))
    uses = [r for r in got[:-1] if isinstance(r, list)]
    # Not even empty units are gathered ahead with a zero window.
    assert uses == [[0], [1], [2], [3], [], [2], [1], [0]]


@pytest.mark.parametrize("reuse, keeps_2", [(80, True), (79, False)])
def test_reuse_distance_boundary_is_inclusive(reuse, keeps_2):
    """Keep when distance <= max_reuse_distance (DeepSpeed keeps within the threshold).

    After forward use of 2 the entries before its backward use are 3, 3: 80 elements.
    """
    sched = schedule(bucket=0, reuse=reuse)
    drive(sched, chain(CHAIN))
    got = drive(sched, chain(CHAIN))
    assert got[5] is (not keeps_2)  # done 2 in forward
    assert got[7] is False  # done 3: used again right after, distance 0
    assert got[10] == ([] if keeps_2 else [2])  # use 2 in backward
    # Unit 0's next use is 180 elements away, 1's 140: released.
    assert got[1] is True and got[3] is True


def test_reuse_is_kept_only_within_the_live_budget():
    # Every next use is within the reuse distance; units 0 and 1 (30 elements) are kept, but
    # keeping unit 2 too would leave 60 gathered with a budget of 50: released.
    sched = schedule(bucket=0, live=50, reuse=1000)
    drive(sched, chain(CHAIN))
    got = drive(sched, chain(CHAIN))
    assert got[1] is False and got[3] is False  # done 0, done 1: kept
    assert got[5] is True  # done 2 in forward
    assert got[10] == [2]  # gathered again for its backward


def test_unit_used_twice_in_one_forward():
    sched = schedule([10, 20, 30], bucket=30)
    program = chain([0, 1, 2, 1])
    drive(sched, program)
    assert sched.trace() == [0, 1, 2, 1, 1, 2, 1, 0]
    got = drive(sched, program)
    # use 2 prefetches 1's next occurrence once and skips its later ones, then takes 0.
    assert got == [
        [0, 1], True,
        [2], True,
        [1, 0], True,
        [], False,
        [], True,
        [2, 1], True,
        [], True,
        [], True,
        ("end", []),
    ]  # fmt: skip


def test_branch_on_one_step_diverges_then_rerecords():
    sched = schedule([10, 20, 30, 40, 5], bucket=1000)
    drive(sched, chain(CHAIN))
    drive(sched, chain(CHAIN))
    assert sched.divergences() == 0
    branch = chain([0, 1, 4, 2, 3])
    assert sched.on_use(0) == [0, 1, 2, 3]
    assert sched.on_done(0) is True
    assert sched.on_use(1) == [0] and not sched.diverged()  # 0's backward use, 80 ahead
    assert sched.on_done(1) is True
    assert sched.on_use(4) == [4]  # not the expected 2: diverged, on demand from here
    assert sched.diverged() and sched.divergences() == 1
    rest = drive(sched, branch[5:])  # from done 4
    uses = [r for r in rest[:-1] if isinstance(r, list)]
    dones = [r for r in rest[:-1] if isinstance(r, bool)]
    # 2, 3 and 0 were prefetched before the divergence; the rest comes on demand.
    assert uses == [[], [], [3], [2], [4], [1], []]
    assert all(dones)  # no reuse keeps once diverged
    assert rest[-1] == ("end", [])
    assert sched.recording() and sched.trace() == []
    drive(sched, chain(CHAIN))  # records afresh
    assert sched.trace() == [0, 1, 2, 3, 3, 2, 1, 0]
    assert sched.on_use(0) == [0, 1, 2, 3]  # replay resumes
    assert sched.divergences() == 1


def test_shorter_pass_counts_as_diverged_and_end_pass_returns_gathered():
    sched = schedule(bucket=60, reuse=100)
    drive(sched, chain(CHAIN))
    got = drive(sched, chain(CHAIN, backward=False))  # eval: forward only
    # Reuse keeps 2 (80 away) and 3 (used right after); 1 and 0 were prefetched for the
    # backward that never came. All four are still gathered at the end.
    assert got[-1] == ("end", [0, 1, 2, 3])
    assert sched.divergences() == 1 and sched.recording() and sched.live_numel() == 0
    drive(sched, chain(CHAIN, backward=False))
    assert sched.trace() == [0, 1, 2, 3] and sched.divergences() == 1


def test_empty_pass_and_invalidate():
    sched = schedule(bucket=1000)
    drive(sched, chain(CHAIN))
    assert sched.end_pass() == [] and not sched.recording()  # an empty pass changes nothing
    assert sched.divergences() == 0
    assert sched.on_use(0) == [0, 1, 2, 3]
    sched.invalidate()  # mid-pass: on demand for the rest, not counted as a divergence
    assert sched.diverged() and sched.divergences() == 0
    assert sched.on_use(3) == [] and sched.on_done(3) is True  # no reuse keeps any more
    assert sched.end_pass() == [0, 1, 2]
    assert sched.recording() and sched.trace() == []
    assert drive(sched, []) == [("end", [])] and sched.recording()  # empty recording


def test_bad_inputs_name_the_value():
    with pytest.raises(RuntimeError, match=r"unit_numel\[1\] must be >= 0, got -3"):
        schedule([1, -3], bucket=0)
    for name in ("prefetch_bucket_size", "max_live_parameters", "max_reuse_distance"):
        kwargs = dict(prefetch_bucket_size=1, max_live_parameters=1, max_reuse_distance=1)
        kwargs[name] = -2
        with pytest.raises(RuntimeError, match=f"{name} must be >= 0, got -2"):
            make_fetch_schedule([1], **kwargs)
    sched = schedule(bucket=0)
    with pytest.raises(RuntimeError, match=r"on_use: unit 4 is out of range \[0, 4\)"):
        sched.on_use(4)
    with pytest.raises(RuntimeError, match=r"on_use: unit -1 is out of range"):
        sched.on_use(-1)
    with pytest.raises(RuntimeError, match="on_done: unit 2 is not gathered"):
        sched.on_done(2)
    with pytest.raises(RuntimeError, match="on_done: unit 9 is out of range"):
        sched.on_done(9)


class ReferenceSchedule:
    """The rules of csrc/zero/fetch_schedule.h, written plainly (linear scans, sets)."""

    def __init__(self, numel, bucket, max_live, reuse):
        self.numel, self.bucket, self.max_live, self.reuse = list(numel), bucket, max_live, reuse
        self.gathered, self.ahead = set(), set()
        self.replay, self.trace, self.recorded = False, [], []
        self.pos, self.in_pass, self.div, self.divs, self.peak = 0, False, False, 0, 0

    def live(self):
        return sum(self.numel[u] for u in self.gathered)

    def _gather(self, unit, out):
        self.gathered.add(unit)
        out.append(unit)
        self.peak = max(self.peak, self.live())

    def on_use(self, unit):
        self.in_pass = True
        out = []
        if unit not in self.gathered:
            self._gather(unit, out)
        self.ahead.discard(unit)
        if self.div:
            return out
        if not self.replay:
            self.recorded.append(unit)
            return out
        if self.pos < len(self.trace) and self.trace[self.pos] == unit:
            self.pos += 1
            for v in self.trace[self.pos :] if self.bucket > 0 else []:
                if v in self.gathered:
                    continue
                ahead = sum(self.numel[a] for a in self.ahead)
                if (
                    (ahead > 0 and ahead + self.numel[v] > self.bucket)  # one unit always fits
                    or self.live() + self.numel[v] > self.max_live
                ):
                    break
                self.ahead.add(v)
                self._gather(v, out)
        else:
            self.div = True
            self.divs += 1
        return out

    def on_done(self, unit):
        assert unit in self.gathered
        if (
            self.replay
            and not self.div
            and self.live() <= self.max_live
            and unit in self.trace[self.pos :]
        ):
            nxt = self.trace.index(unit, self.pos)
            if sum(self.numel[t] for t in self.trace[self.pos : nxt]) <= self.reuse:
                return False
        self.gathered.discard(unit)
        self.ahead.discard(unit)
        return True

    def end_pass(self):
        still = sorted(self.gathered)
        self.gathered.clear()
        self.ahead.clear()
        if self.in_pass:
            if self.replay and not self.div and self.pos != len(self.trace):
                self.div, self.divs = True, self.divs + 1
            if self.div:
                self.replay, self.trace = False, []
            elif not self.replay and self.recorded:
                self.replay, self.trace = True, self.recorded
        self.recorded, self.pos, self.in_pass, self.div = [], 0, False, False
        return still

    def invalidate(self):
        self.replay, self.trace, self.recorded = False, [], []
        if self.in_pass:
            self.div = True


def random_run(seed):
    """A list of calls: passes of a random model, some perturbed (branch, eval, skipped module)."""
    rng = random.Random(seed)
    units = rng.randint(1, 8)
    numel = [rng.choice([0, rng.randint(1, 60)]) for _ in range(units)]
    budgets = [rng.choice([0, rng.randint(1, 200), 10**6]) for _ in range(3)]
    modules = []
    for _ in range(rng.randint(1, 7)):
        first = rng.randrange(units)
        others = [u for u in range(units) if u != first]
        nested = others and rng.random() < 0.3
        modules.append((first, rng.choice(others)) if nested else (first,))
    calls = []
    for _ in range(rng.randint(3, 8)):
        mods, backward = list(modules), True
        kind = rng.random()
        if kind < 0.2:
            mods.insert(rng.randint(0, len(mods)), (rng.randrange(units),))  # a branch
        elif kind < 0.3:
            backward = False  # eval
        elif kind < 0.4 and len(mods) > 1:
            mods.pop(rng.randrange(len(mods)))
        events = pass_events(mods, backward)
        if rng.random() < 0.1:
            events.insert(rng.randint(0, len(events)), ("invalidate", None))
        if rng.random() < 0.1:
            events.insert(rng.randint(0, len(events)), ("reset_peak", None))
        calls += events + [("end", None)]
    return numel, budgets, calls


def run_calls(sched, calls):
    """Every decision and the observable state after each call."""
    log = []
    for kind, unit in calls:
        if kind == "use":
            result = list(sched.on_use(unit))
        elif kind == "done":
            result = sched.on_done(unit)
        elif kind == "end":
            result = list(sched.end_pass())
        else:
            result = getattr(sched, kind)()
        log.append((kind, unit, result))
    return log


def observe(sched, calls):
    log = []
    for call in calls:
        log += run_calls(sched, [call])
        log.append((sched.live_numel(), sched.peak_live_numel(), sched.divergences()))
        log.append((sched.recording(), sched.diverged(), list(sched.trace())))
    return log


class ReferenceView:
    """ReferenceSchedule behind the accessors of the C++ class."""

    def __init__(self, ref):
        self.ref = ref
        self.on_use, self.on_done, self.end_pass = ref.on_use, ref.on_done, ref.end_pass
        self.invalidate = ref.invalidate

    def reset_peak(self):
        self.ref.peak = self.ref.live()

    def live_numel(self):
        return self.ref.live()

    def peak_live_numel(self):
        return self.ref.peak

    def divergences(self):
        return self.ref.divs

    def recording(self):
        return not self.ref.replay

    def diverged(self):
        return self.ref.div

    def trace(self):
        return self.ref.trace


@pytest.mark.parametrize("seed", range(50))
def test_random_traces_match_reference_model(seed):
    numel, (bucket, live, reuse), calls = random_run(seed)
    sched = schedule(numel, bucket=bucket, live=live, reuse=reuse)
    reference = ReferenceView(ReferenceSchedule(numel, bucket, live, reuse))
    assert observe(sched, calls) == observe(reference, calls)


def test_random_traces_are_deterministic():
    for seed in range(100, 120):
        numel, (bucket, live, reuse), calls = random_run(seed)
        first = schedule(numel, bucket=bucket, live=live, reuse=reuse)
        second = schedule(numel, bucket=bucket, live=live, reuse=reuse)
        assert run_calls(first, calls) == run_calls(second, calls)


def test_on_use_and_diverged_answers_both_questions_of_one_use():
    # The coordinator's one call per use: the same launches, and then the same divergence
    # state, as on_use followed by diverged(), through passes that branch, stop early and skip.
    for seed in range(200, 230):
        numel, (bucket, live, reuse), calls = random_run(seed)
        separate = schedule(numel, bucket=bucket, live=live, reuse=reuse)
        combined = schedule(numel, bucket=bucket, live=live, reuse=reuse)
        for kind, unit in calls:
            if kind == "use":
                expected = (list(separate.on_use(unit)), separate.diverged())
                launches, diverged = combined.on_use_and_diverged(unit)
                assert (list(launches), diverged) == expected
            else:
                args = () if unit is None else (unit,)
                method = {"done": "on_done", "end": "end_pass"}.get(kind, kind)
                assert getattr(combined, method)(*args) == getattr(separate, method)(*args)
        assert combined.divergences() == separate.divergences()
    with pytest.raises(RuntimeError, match="unit 9"):
        combined.on_use_and_diverged(9)  # the same checks as on_use


def test_window_takes_one_unit_larger_than_the_bucket():
    # A unit above the bucket (a transformer layer above stage3_prefetch_bucket_size) is still
    # prefetched, alone: the window always takes one unit; a second one must fit the bucket.
    sched = schedule([10, 60, 70, 5], bucket=50)
    drive(sched, chain(CHAIN, backward=False))
    got = drive(sched, chain(CHAIN, backward=False))
    uses = [r for r in got[:-1] if isinstance(r, list)]
    assert uses == [[0, 1], [2], [3], []]
