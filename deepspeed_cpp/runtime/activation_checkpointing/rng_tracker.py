"""Named random-number states for model-parallel dropout (DeepSpeed's ``CudaRNGStatesTracker``).

Under tensor (model) parallelism each rank holds a slice of a layer. Dropout applied to a slice
must draw a different mask on every model-parallel rank, while dropout outside the parallel
region must draw the same mask on all of them. The default generator serves the latter; a named
state, forked into for the parallel region, serves the former. ``fork`` swaps the accelerator's
default generator state for the named one and back, keeping the advanced named state, so that
successive forks draw fresh numbers, and a checkpoint's recomputation, which restores the states
it saw at forward, draws the same ones again.

The states are those of ``get_accelerator()``'s default generator: the CUDA generator on a GPU,
torch's CPU generator on the CPU accelerator, so the same code is exact on both.
"""

from __future__ import annotations

import contextlib

from ...accelerator import get_accelerator
from ...utils.logging import logger

MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"

# DeepSpeed (after Megatron-LM) seeds the model-parallel state ``seed + 2718 + tp_rank``: any
# positive offset separates it from the data-parallel ``seed``; 2718 is theirs, kept so that a
# script seeded the same way draws the same masks here as under DeepSpeed.
MODEL_PARALLEL_SEED_OFFSET = 2718


class RNGStateError(RuntimeError):
    """A tracker name or seed was added twice, or a name forked that was never added."""


class CudaRNGStatesTracker:
    """Named generator states of the current accelerator; ``fork(name)`` runs code in one."""

    def __init__(self):
        self.states_ = {}
        # Seeds already given to a name: two names on one seed would draw identical masks.
        self.seeds_ = set()

    def reset(self) -> None:
        """Forgets every name and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict:
        """A copy of the name -> state map (the state tensors themselves are never mutated:
        ``fork`` stores a new tensor, so a copy taken now keeps describing now)."""
        return dict(self.states_)

    def set_states(self, states: dict) -> None:
        """Replaces the name -> state map (a checkpoint's recomputation puts back the one it saw
        at forward)."""
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """A new named state, as the default generator would be after ``manual_seed(seed)``;
        the default generator itself is left as it was."""
        if seed in self.seeds_:
            raise RNGStateError(
                f"CudaRNGStatesTracker.add({name!r}, {seed}): seed {seed} is already tracked "
                "under another name; each name needs its own"
            )
        if name in self.states_:
            raise RNGStateError(
                f"CudaRNGStatesTracker.add({name!r}, {seed}): the name {name!r} is already tracked"
            )
        accelerator = get_accelerator()
        previous = accelerator.get_rng_state()
        accelerator.manual_seed(seed)
        self.states_[name] = accelerator.get_rng_state()
        accelerator.set_rng_state(previous)
        self.seeds_.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Runs the body with the default generator in state ``name``; afterwards ``name``
        keeps the advanced state and the default generator is back where it was."""
        if name not in self.states_:
            raise RNGStateError(
                f"CudaRNGStatesTracker.fork({name!r}): no state of that name; tracked: "
                f"{sorted(self.states_)} (model_parallel_cuda_manual_seed(seed) adds "
                f"{MODEL_PARALLEL_RNG_TRACKER_NAME!r})"
            )
        accelerator = get_accelerator()
        outside = accelerator.get_rng_state()
        accelerator.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = accelerator.get_rng_state()
            accelerator.set_rng_state(outside)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process's tracker (the one ``checkpoint`` saves and restores)."""
    return _TRACKER


def tensor_parallel_rank(mpu) -> int:
    """The tensor-model-parallel rank from any of the ``mpu`` conventions DeepSpeed accepts:
    ``get_tensor_model_parallel_rank`` (Megatron, DeepSpeed's pipeline grid), the older
    ``get_slice_parallel_rank``, or ``get_model_parallel_rank``; 0 without an mpu."""
    if mpu is None:
        return 0
    for method in ("get_tensor_model_parallel_rank", "get_slice_parallel_rank"):
        if hasattr(mpu, method):
            return getattr(mpu, method)()
    return mpu.get_model_parallel_rank()


def seed_model_parallel(seed: int, mpu) -> None:
    """DeepSpeed's ``model_parallel_cuda_manual_seed``: the default generator gets ``seed``
    (equal on the ranks of a model-parallel group, for dropout outside parallel regions) and the
    tracker, reset, gets ``seed + 2718 + tensor-parallel rank`` under the model-parallel name
    (different on each rank of the group, equal across data-parallel replicas)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"model_parallel_cuda_manual_seed(seed={seed!r}): expected an int")
    tp_rank = tensor_parallel_rank(mpu)
    model_parallel_seed = seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank
    logger.debug(
        "model-parallel seeds: tensor-parallel rank %d, model-parallel seed %d, "
        "data-parallel seed %d",
        tp_rank,
        model_parallel_seed,
        seed,
    )
    _TRACKER.reset()
    get_accelerator().manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG_TRACKER_NAME, model_parallel_seed)


def reseed_model_parallel(seed: int, mpu) -> None:
    """DeepSpeed's ``model_parallel_reconfigure_tp_seed``: re-seeds only the model-parallel
    state (``seed + 2718 + tensor-parallel rank``), leaving the default generator alone."""
    with _TRACKER.fork():
        get_accelerator().manual_seed(seed + MODEL_PARALLEL_SEED_OFFSET + tensor_parallel_rank(mpu))
