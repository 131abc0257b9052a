"""DeepSpeed's base class for multi-node launch back-ends, under
``deepspeed.launcher.multinode_runner``.

The pdsh / OpenMPI / MVAPICH / Slurm back-ends themselves are out of scope (multi-node launches go
through torchrun here, ``runner.py``); the base stays because scripts that add a back-end of their
own subclass it and build their ``export`` lines with ``add_export``, whose quoting rule matters:
a value a shell would misread (``64(x2)``, spaces) is double-quoted, a plain one (a path) is not,
since quotes kept literally would break, say, ``PYTHONPATH``.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod

# Characters a shell passes through unquoted in ``export KEY=value``; anything else gets quotes.
_SHELL_SAFE = re.compile(r"[\w@%+=:,./-]*")


class MultiNodeRunner(ABC):
    """A multi-node back-end: ``args`` are the launcher's parsed arguments (``user_script``,
    ``user_args``), ``world_info_base64`` the encoded host-to-slots map passed to every node."""

    def __init__(self, args, world_info_base64: str) -> None:
        self.args = args
        self.validate_args()
        self.user_arguments = self.parse_user_args()
        self.user_script = args.user_script
        self.world_info_base64 = world_info_base64
        self.exports: dict[str, str] = {}

    @abstractmethod
    def backend_exists(self) -> bool:
        """Whether this back-end's tool is installed."""

    @abstractmethod
    def get_cmd(self, environment, active_resources) -> list[str]:
        """The command that starts the job on the nodes."""

    def add_export(self, key: str, var: str) -> None:
        """Records ``key=var`` for the nodes' environment, double-quoting a value a shell would
        not take bare."""
        var = var.strip()
        if not _SHELL_SAFE.fullmatch(var):
            var = f'"{var}"'
        self.exports[key.strip()] = var

    def parse_user_args(self) -> list[str]:
        return self.args.user_args

    @property
    def name(self) -> str:
        return type(self).__name__

    def validate_args(self) -> None:
        """Checks ``self.args`` for this back-end; the base accepts anything."""
        return None

    @classmethod
    def validate_active_resources(cls, active_resources) -> None:
        """Checks an ``--include``/``--exclude`` selection against what the back-end can launch;
        the base accepts any."""
        return None
