"""Process topologies for pipeline (× data × model) parallelism, and the grid of process groups
built from one.

The rank layout is DeepSpeed's: ranks enumerate the coordinates in row-major order over the axes
as given (the last axis varies fastest), so with ``PipeDataParallelTopology(num_pp=2, num_dp=2)``
ranks 0, 1 are stage 0 (data 0, 1) and ranks 2, 3 stage 1. Checkpoints and scripts written for
DeepSpeed name ranks by these coordinates, so the layout must not change.
"""

from __future__ import annotations

import itertools
from collections import namedtuple

import torch.distributed as dist

from ...comm.collective_errors import new_group


class ProcessTopology:
    """Maps every process's coordinate on named axes (``pipe``, ``data``, ``model``, ...) to a
    rank and back."""

    def __init__(self, axes: list[str], dims: list[int]):
        axes, dims = list(axes), [int(d) for d in dims]
        if len(axes) != len(dims):
            raise ValueError(
                f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims {dims}"
            )
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axis names must be distinct, got {axes}")
        bad = [(a, d) for a, d in zip(axes, dims) if d < 1]
        if bad:
            raise ValueError(f"ProcessTopology: every dimension must be >= 1, got {bad}")
        self.axes = axes
        self.dims = dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)
        self.mapping: dict = {}
        for rank, coord in enumerate(itertools.product(*(range(d) for d in dims))):
            self.mapping[self.ProcessCoord(*coord)] = rank
        self._coords = list(self.mapping)  # index = rank

    def get_rank(self, **coord_kwargs) -> int:
        """The rank at a full coordinate, e.g. ``get_rank(pipe=1, data=0)``."""
        if set(coord_kwargs) != set(self.axes):
            raise ValueError(
                f"get_rank() needs one coordinate per axis {self.axes}, got {sorted(coord_kwargs)} "
                "(use filter_match() for a slice)"
            )
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"get_rank(): coordinate {coord_kwargs} is outside dims {self.dims}")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_rank_repr(self, rank, omit_axes=("data", "pipe"), inner_sep="_", outer_sep="-") -> str:
        """The coordinate of ``rank`` on the axes not omitted, as checkpoint names spell it
        (``model_01``)."""
        coord = self.get_coord(rank)
        omit = frozenset(omit_axes)
        return outer_sep.join(
            f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes if axis not in omit
        )

    def get_dim(self, axis: str) -> int:
        """The length of ``axis``; 0 for an axis this topology does not have (as DeepSpeed)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int):
        if not 0 <= rank < len(self._coords):
            raise ValueError(f"rank {rank} not found in topology (world size {self.world_size()})")
        return self._coords[rank]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The groups of ranks that differ only in ``axis`` (each ordered along ``axis``), one per
        combination of the other coordinates; ``[]`` for an unknown axis."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for values in itertools.product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, values))
            along = range(self.get_dim(axis))
            lists.append([self.mapping[self.ProcessCoord(**fixed, **{axis: i})] for i in along])
        return lists

    def filter_match(self, **filter_kwargs) -> list[int]:
        """The ranks whose coordinates equal every given one, in rank order."""
        unknown = set(filter_kwargs) - set(self.axes)
        if unknown:
            raise ValueError(
                f"filter_match(): unknown axes {sorted(unknown)}; axes are {self.axes}"
            )
        return [
            rank
            for rank, coord in enumerate(self._coords)
            if all(getattr(coord, k) == v for k, v in filter_kwargs.items())
        ]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose coordinate on ``axis`` is ``idx``."""
        return self.filter_match(**{axis: idx})

    def world_size(self) -> int:
        return len(self.mapping)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline × data parallelism; data is the fastest axis, so a stage's replicas are
    neighbouring ranks (its gradient all-reduce stays on the fast links of a node)."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline × data × model (tensor) parallelism, model the fastest axis."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


class PipelineParallelGrid:
    """This process's place in a topology and the process groups along each axis.

    Every rank creates every group (``dist.new_group`` is collective over the world), keeping the
    ones it belongs to: ``pipe`` (the stages of one replica), ``data`` (the replicas of one
    stage), ``model`` (DeepSpeed's meaning for pipelines: every stage and tensor slice of one
    replica, the group whole-model norms are summed over) and ``slice`` (tensor parallelism).
    It also serves as the ``mpu`` DeepSpeed's engines take.
    """

    def __init__(self, topology: ProcessTopology, process_group=None):
        self._topo = topology
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if topology.world_size() != self.world_size:
            raise ValueError(
                f"the pipeline topology {dict(zip(topology.axes, topology.dims))} holds "
                f"{topology.world_size()} processes but the world has {self.world_size}"
            )
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.model_parallel_size = max(topology.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        coord = topology.get_coord(self.global_rank)
        self.stage_id = getattr(coord, "pipe", 0)
        self.data_parallel_id = getattr(coord, "data", 0)
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1

        # A replica: the ranks sharing this data coordinate.
        if "data" in topology.axes:
            replicas = [topology.get_axis_list("data", d) for d in range(self.data_parallel_size)]
        else:
            replicas = [list(range(self.world_size))]
        self.ds_model_group_ranks, self.ds_model_proc_group = self._make_groups(replicas)
        self.ds_model_world_size = len(self.ds_model_group_ranks)
        self.ds_model_rank = self.ds_model_group_ranks.index(self.global_rank)

        self.dp_groups = self._axis_lists("data")
        self.dp_group, self.dp_proc_group = self._make_groups(self.dp_groups)
        self.pipe_groups = self._axis_lists("pipe")
        self.pp_group, self.pp_proc_group = self._make_groups(self.pipe_groups)
        self.model_groups = self._axis_lists("model")
        self.slice_group, self.slice_proc_group = self._make_groups(self.model_groups)
        self.p2p_groups = [
            [rank, ranks[(ranks.index(rank) + 1) % len(ranks)]]
            for rank in range(self.world_size)
            for ranks in self.pipe_groups
            if rank in ranks
        ]

    def _axis_lists(self, axis: str) -> list[list[int]]:
        """Groups along ``axis``; one rank each where the topology lacks the axis."""
        lists = self._topo.get_axis_comm_lists(axis)
        return lists if lists else [[rank] for rank in range(self.world_size)]

    def _make_groups(self, rank_lists: list[list[int]]):
        mine = None
        for ranks in rank_lists:
            group = new_group(ranks)
            if self.global_rank in ranks:
                mine = (list(ranks), group)
        if mine is None:
            raise RuntimeError(f"rank {self.global_rank} is in none of the groups {rank_lists}")
        return mine

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **kwargs) -> int:
        """The global rank of ``stage_id`` with this process's other coordinates (or those in
        ``kwargs``)."""
        coord = self._topo.get_coord(self.global_rank)._replace(pipe=stage_id, **kwargs)
        return self._topo.get_rank(**coord._asdict())

    def get_global_rank(self) -> int:
        return self.global_rank

    # pipe
    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self):
        return self.pp_proc_group

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    # data
    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_group

    # model: for pipelines every stage (and slice) of one replica, as DeepSpeed
    def get_model_parallel_rank(self) -> int:
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self):
        return self.ds_model_proc_group

    # slice (tensor parallelism)
    def get_slice_parallel_rank(self) -> int:
        coord = self._topo.get_coord(self.global_rank)
        return getattr(coord, "model", 0)

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self):
        return self.slice_proc_group

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size
