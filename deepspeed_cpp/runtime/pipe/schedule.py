"""Pipeline schedules as instruction streams: a schedule says, for one stage, which instructions
to run and in what order; the engine only executes them (``engine.py``). Keeping the order here,
as data, makes it readable and testable without processes.

``TrainSchedule`` is 1F1B: stage ``s`` of ``S`` runs ``S - s - 1`` warm-up forwards, then
alternates one forward and one backward, then drains the remaining backwards; the activations
held at once per stage are bounded by ``S - s`` whatever the number of micro-batches. Sends are
non-blocking, receives block; with that, this order cannot deadlock (every receive waits on a
send its neighbour issues earlier in its own order).
"""

from __future__ import annotations

from collections.abc import Iterator


class PipeInstruction:
    """One step of a schedule; ``kwargs`` (a ``buffer_id`` for most) become attributes."""

    def __init__(self, **kwargs):
        self.name = type(self).__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.kwargs.items())
        return f"{self.name}({args})"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.kwargs == other.kwargs

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.kwargs.items()))))


class BufferOpInstruction(PipeInstruction):
    def __init__(self, buffer_id: int, **kwargs):
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Read the next micro-batch from the data iterator (inputs on the first stage, labels on
    the last)."""


class ForwardPass(BufferOpInstruction):
    pass


class BackwardPass(BufferOpInstruction):
    pass


class SendActivation(BufferOpInstruction):
    pass


class RecvActivation(BufferOpInstruction):
    pass


class SendGrad(BufferOpInstruction):
    pass


class RecvGrad(BufferOpInstruction):
    pass


class ReduceTiedGrads(PipeInstruction):
    """Sum tied weights' gradients over the stages sharing them."""


class ReduceGrads(PipeInstruction):
    """Average the stage's gradients over its data-parallel replicas."""


class OptimizerStep(PipeInstruction):
    pass


class PipeSchedule:
    """The instructions one stage runs for one batch of ``micro_batches``; iterate ``steps()``
    (a list of instructions per step) or the schedule itself (the same, flattened per step)."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int):
        if micro_batches < 1:
            raise ValueError(f"a schedule needs micro_batches >= 1, got {micro_batches}")
        if not 0 <= stage_id < stages:
            raise ValueError(f"stage_id {stage_id} is outside 0..{stages - 1}")
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def steps(self) -> Iterator[list[PipeInstruction]]:
        raise NotImplementedError

    def num_pipe_buffers(self) -> int:
        return self.micro_batches

    def _buffer(self, micro_batch: int) -> int:
        return micro_batch % self.num_pipe_buffers()

    def _forward_step(self, micro_batch: int) -> list[PipeInstruction]:
        buffer = self._buffer(micro_batch)
        step: list[PipeInstruction] = []
        if self.is_first_stage or self.is_last_stage:
            step.append(LoadMicroBatch(buffer))
        if not self.is_first_stage:
            step.append(RecvActivation(buffer))
        step.append(ForwardPass(buffer))
        if not self.is_last_stage:
            step.append(SendActivation(buffer))
        return step

    def __iter__(self):
        yield from self.steps()


class InferenceSchedule(PipeSchedule):
    """Forwards only, one micro-batch after another."""

    def steps(self):
        for micro_batch in range(self.micro_batches):
            yield self._forward_step(micro_batch)

    def num_pipe_buffers(self) -> int:
        return 2 if self.micro_batches > 1 else 1


class TrainSchedule(PipeSchedule):
    """1F1B (see the module docstring), then the tied and data-parallel gradient reductions and
    the optimizer step."""

    def warmup_forwards(self) -> int:
        return min(self.stages - self.stage_id - 1, self.micro_batches)

    def num_pipe_buffers(self) -> int:
        return max(1, min(self.stages - self.stage_id, self.micro_batches))

    def steps(self):
        forwards = backwards = 0
        for _ in range(self.warmup_forwards()):
            yield self._forward_step(forwards)
            forwards += 1
        while backwards < self.micro_batches:
            if forwards < self.micro_batches:
                yield self._forward_step(forwards)
                forwards += 1
            yield self._backward_step(backwards)
            backwards += 1
        yield [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]

    def _backward_step(self, micro_batch: int) -> list[PipeInstruction]:
        buffer = self._buffer(micro_batch)
        step: list[PipeInstruction] = []
        if not self.is_last_stage:
            step.append(RecvGrad(buffer))
        step.append(BackwardPass(buffer))
        if not self.is_first_stage:
            step.append(SendGrad(buffer))
        return step
