"""Per-device random state: a (seed, offset) pair, laid out as PyTorch's Philox generators keep
it (16 bytes: the seed, then the offset, each a little-endian uint64).

A random op draws the i-th element of what it samples from counter `offset + i` of a
counter-based generator (threefry2x32 keyed by the seed: `_impl`, a JAX PRNG implementation,
so every `jax.random` sampler works on it unchanged), and the offset then advances by the number
of elements drawn, rounded up to a multiple of 4, as CUDA's Philox offsets advance.  Two
consequences users rely on:
- a draw of n elements is the first n of a longer draw from the same state (strict eager fills
  a few bucketed sizes and keeps the first elements: op_kernel.OpKernel._bucketed_fill);
- DTensor's random-op tracker (torch.distributed.tensor._random), which moves the offset to the
  first element of each rank's shard, makes a sharded draw the ranks' parts of one stream: a
  model initialised sharded (FSDP2 on `meta`, then `to_empty` and `reset_parameters`) gets the
  values the whole model gets from the same seed on one device.
The seed and offset are arguments of the executables (never constants), so a new offset never
recompiles."""
import random as _pyrandom

import jax
import jax.extend.random as _jax_random
import jax.numpy as jnp
import numpy as np
import torch

from .._core import runtime

_DEFAULT_SEED = 67280421310721
_MASK64 = (1 << 64) - 1


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


def draw_advance(n):
    """How far a draw of n elements moves the offset (CUDA's Philox: multiples of 4)."""
    return (int(n) + 3) // 4 * 4


def next_key_parts(index, draws):
    """(seed, offset) for a random op drawing `draws` elements on device `index`; the device's
    offset moves past them."""
    g = generator(index)
    offset = g.offset
    g.offset = (offset + draw_advance(draws)) & _MASK64
    return np.uint64(g.seed & _MASK64), np.uint64(offset)


# --- the counter-based PRNG: key data [seed_hi, seed_lo, offset_hi, offset_lo] (uint32) -------
def _words(value):
    value = value.astype(jnp.uint64)
    return (value >> jnp.uint64(32)).astype(jnp.uint32), value.astype(jnp.uint32)


def _hash(key, tag, data):
    """Two uint32 words from the key's seed, a domain tag and `data` (a uint32 array, any
    shape): the seeds of keys derived by split and fold_in (same offset, other streams)."""
    data = jnp.asarray(data, jnp.uint32).reshape(-1)
    counts = jnp.concatenate([jnp.full(data.shape, tag, jnp.uint32), data])
    return _jax_random.threefry_2x32(key[:2], counts).reshape(2, -1)


def _seed(seed):
    seed = jnp.asarray(seed).astype(jnp.uint64)
    hi, lo = _words(seed)
    zero = jnp.zeros((), jnp.uint32)
    return jnp.stack([hi, lo, zero, zero])


def _split(key, shape):
    n = int(np.prod(shape))
    seeds = _hash(key, 0x53504C54, jnp.arange(n, dtype=jnp.uint32))  # "SPLT"
    offsets = jnp.broadcast_to(key[2:, None], (2, n))
    return jnp.concatenate([seeds, offsets]).T.reshape(*shape, 4)


def _fold_in(key, data):
    seed = _hash(key, 0x464F4C44, data)  # "FOLD"
    return jnp.concatenate([seed[:, 0], key[2:]])


def _random_bits(key, bit_width, shape):
    n = int(np.prod(shape))
    offset = (key[2].astype(jnp.uint64) << jnp.uint64(32)) | key[3].astype(jnp.uint64)
    hi, lo = _words(offset + jnp.arange(n, dtype=jnp.uint64))
    out = _jax_random.threefry_2x32(key[:2], jnp.concatenate([hi, lo]))
    first, second = out[:n], out[n:]
    if bit_width == 64:
        bits = (first.astype(jnp.uint64) << jnp.uint64(32)) | second.astype(jnp.uint64)
    else:
        bits = first.astype({8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bit_width])
    return bits.reshape(shape)


_impl = _jax_random.define_prng_impl(
    key_shape=(4,), seed=_seed, split=_split, random_bits=_random_bits, fold_in=_fold_in,
    name="torchtpu_counter_threefry", tag="tt")


def key_from_parts(seed, offset):
    """The key of one random op, inside its executable: element i draws from counter
    offset + i of the stream `seed` names."""
    seed_hi, seed_lo = _words(seed)
    off_hi, off_lo = _words(offset)
    return jax.random.wrap_key_data(jnp.stack([seed_hi, seed_lo, off_hi, off_lo]), impl=_impl)


# --- torch.tpu's generator functions ---------------------------------------------------------
def manual_seed(seed, index=None):
    g = generator(index)
    g.seed = int(seed) & _MASK64
    g.offset = 0


def manual_seed_all(seed):
    # Without asking the runtime how many devices there are: torch.manual_seed calls this, and
    # must not start JAX's runtime (init_process_group and DataLoader workers need it unstarted).
    _seed_for_new[0] = int(seed) & _MASK64
    for index in _generators:
        manual_seed(seed, index)


def seed(index=None):
    s = _pyrandom.getrandbits(63)
    manual_seed(s, index)
    return s


def initial_seed(index=None):
    return generator(index).seed


def get_rng_state(index=None):
    """16 bytes: seed and offset as little-endian uint64s (CUDA's Philox state layout, which
    DTensor's random-op tracker reads and writes)."""
    g = generator(index)
    state = np.array([g.seed, g.offset], dtype="<u8").view(np.uint8)
    return torch.from_numpy(state.copy())


def set_rng_state(state, index=None):
    state = torch.as_tensor(state)
    if state.dtype != torch.uint8 or state.numel() != 16:
        raise RuntimeError(f"RNG state must be a torch.ByteTensor of 16 bytes (seed and offset), "
                           f"got {state.dtype} of {state.numel()} elements")
    seed, offset = np.frombuffer(state.detach().cpu().contiguous().numpy().tobytes(), "<u8")
    g = generator(index)
    g.seed = int(seed)
    g.offset = int(offset)
