from .builder import OpBuilder


class RegistryBuilder(OpBuilder):
    """The library holding every schema (csrc/registration.cpp); loaded before any op family."""

    NAME = "registry"
    NEEDS_REGISTRY = False
    STABLE_ABI = True

    def sources(self) -> list[str]:
        return ["registration.cpp"]
