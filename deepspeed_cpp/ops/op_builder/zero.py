from .builder import OpBuilder


class ZeroBuilder(OpBuilder):
    """csrc/zero: flat copies, bucket planning, the c10d gradient reducer, ZeRO-3 fetch schedule."""

    NAME = "zero"

    def sources(self) -> list[str]:
        return [
            "zero/zero_op.cpp",
            "zero/bucket_plan.cpp",
            "zero/grad_reducer.cpp",
            "zero/reducer_buffers.cpp",
            "zero/fetch_schedule.cpp",
            "zero/fetch_schedule_op.cpp",
        ]
