"""Per-device random state: a (seed, offset) pair, like PyTorch's Philox generators.

Each random op consumes one offset; the key is derived inside the compiled executable, so
changing the offset never recompiles."""
import random as _pyrandom

import jax
import numpy as np
import torch

from .._core import runtime

_DEFAULT_SEED = 67280421310721


class DeviceGenerator:
    __slots__ = ("seed", "offset")

    def __init__(self, seed=_DEFAULT_SEED):
        self.seed = seed
        self.offset = 0


_generators = {}
_seed_for_new = [_DEFAULT_SEED]  # manual_seed_all's seed, for the devices not used yet


def generator(index=None):
    if index is None:
        index = runtime.current_device()
    g = _generators.get(index)
    if g is None:
        g = _generators[index] = DeviceGenerator(_seed_for_new[0])
    return g


def next_key_parts(index):
    g = generator(index)
    g.offset += 1
    return np.uint64(g.seed & 0xFFFFFFFFFFFFFFFF), np.uint64(g.offset)


def key_from_parts(seed, offset):
    seed = seed.astype(np.uint64)
    hi = (seed >> np.uint64(32)).astype(np.uint32)
    lo = (seed & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(lo), hi), offset.astype(np.uint32))
    return jax.random.fold_in(key, (offset >> np.uint64(32)).astype(np.uint32))


def manual_seed(seed, index=None):
    g = generator(index)
    g.seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    g.offset = 0


def manual_seed_all(seed):
    # Without asking the runtime how many devices there are: torch.manual_seed calls this, and
    # must not start JAX's runtime (init_process_group and DataLoader workers need it unstarted).
    _seed_for_new[0] = int(seed) & 0xFFFFFFFFFFFFFFFF
    for index in _generators:
        manual_seed(seed, index)


def seed(index=None):
    s = _pyrandom.getrandbits(63)
    manual_seed(s, index)
    return s


def initial_seed(index=None):
    return generator(index).seed


def get_rng_state(index=None):
    g = generator(index)
    return torch.tensor([g.seed & ((1 << 63) - 1), g.seed >> 63, g.offset], dtype=torch.int64).view(torch.uint8)


def set_rng_state(state, index=None):
    seed_lo, seed_hi, offset = state.view(torch.int64).tolist()
    g = generator(index)
    g.seed = seed_lo | (seed_hi << 63)
    g.offset = offset
