from .builder import OpBuilder


class ZeroBuilder(OpBuilder):
    """csrc/zero: flat-buffer copies, bucket planning and the c10d gradient reducer."""

    NAME = "zero"

    def sources(self) -> list[str]:
        return ["zero/zero_op.cpp", "zero/bucket_plan.cpp", "zero/grad_reducer.cpp"]
