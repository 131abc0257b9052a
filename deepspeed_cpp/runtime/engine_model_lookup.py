"""Names a DeepSpeed engine answers beyond its own: an attribute the engine lacks is looked up on
the model (scripts write ``engine.some_layer`` or ``engine.config_of_my_model``, as DeepSpeed's
engine allows), and ``engine._config``, DeepSpeed's private name for the config that scripts read
(e.g. ``engine._config.train_micro_batch_size_per_gpu`` for their own DataLoader)."""

from __future__ import annotations


class EngineModelLookup:
    """Mixed into ``DeepSpeedEngine`` ahead of ``torch.nn.Module``, whose ``__getattr__`` (the
    module's parameters, buffers and submodules) is asked first."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None and name != "module":
                try:
                    return getattr(module, name)
                except AttributeError:
                    pass
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute '{name}' (nor has its model, "
                f"{type(module).__name__ if module is not None else 'not set yet'})"
            ) from None

    @property
    def _config(self):
        """The same object as ``engine.config``, read-only."""
        return self.config
