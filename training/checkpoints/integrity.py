"""Fingerprints of a pytree's array contents, to tell a restored checkpoint from a silently damaged one.

A checkpoint records, per leaf, two 32-bit sums of the leaf's bits; restoring recomputes them for the
leaves read back and compares. For a leaf with bit patterns u_i (its elements bitcast to uint32, flat
index i):

  weighted = sum_i (2 i + 1) * u_i         mod 2^32
  mixed    = sum_i mix(u_i XOR mix(i))     mod 2^32    (mix: MurmurHash3's 32-bit finalizer, a bijection)

A flipped bit changes `weighted` by an odd multiple of a power of two below 2^32, so never by 0 mod 2^32;
any change of one element changes `mixed` (mix is a bijection); swapped elements change both. Several
changes cancel in both sums with probability about 2^-64. Sums mod 2^32 do not depend on the order of
the reduction, so the fingerprint is the same on any mesh and any number of processes.

A leaf this process holds whole is summed in NumPy on the host, whose uint32 arithmetic wraps as the
formula wants: no XLA program to compile, where jitted sums compile one per leaf shape and dtype (most
of what a translate.py start would compile besides its decoding). A leaf spread over processes is summed
by a jitted program on the devices where it lives; the result of its global reduction is replicated, so
every process sees the same verdict.

The same pass says whether each floating-point leaf is finite, so a diverged state is refused before
it is written, and a restored one before it is used.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from common.errors import UserInputError

# The JSON item saved with each checkpoint: {'version', 'method', 'leaves': {name: {'dtype', 'weighted', 'mixed'}}}.
FORMAT_VERSION = 1
METHOD = "per-leaf sums mod 2^32 of the uint32 bit patterns: odd-weighted and MurmurHash3-mixed"


def leaf_names(tree: Any) -> list[str]:
    """'params/encoder/layers_0/.../kernel' for each leaf, in jax.tree.leaves order."""
    return [
        jax.tree_util.keystr(path, simple=True, separator="/") for path, _ in jax.tree_util.tree_leaves_with_path(tree)
    ]


def _mix(x):
    """MurmurHash3's finalizer on uint32 (jax or NumPy arrays): a bijection spreading each input bit over the output."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _terms(bits, index):
    """The summands of `weighted` and `mixed` (the module docstring's formula) at bit patterns `bits` and flat
    indices `index`: uint32 arrays of one shape, jax or NumPy (both wrap mod 2^32)."""
    return bits * (index * 2 + 1), _mix(bits ^ _mix(index))


def _bits(x: jax.Array) -> jax.Array:
    """The leaf's bit patterns as uint32: 8- and 16-bit elements widened, 64-bit ones split in two."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = np.dtype(x.dtype).itemsize
    if width in (1, 2):
        return jax.lax.bitcast_convert_type(x, jnp.uint8 if width == 1 else jnp.uint16).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.uint32)  # 4 bytes: same shape; 8 bytes: a trailing [2].


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    """Row-major element index (mod 2^32) of every position of `shape`, built from iotas (shards stay local)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return index


@jax.jit
def _leaf_summary(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[2] uint32 fingerprint and [] bool 'finite' of one leaf, on its devices (a leaf spread over processes).

    Compiled per leaf shape, dtype and sharding: a model repeats a few shapes across its layers,
    and one program over all leaves of a large state is slow to compile.
    """
    bits = _bits(x)
    weighted, mixed = _terms(bits, _flat_index(bits.shape))
    finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.array(True)
    return jnp.stack([jnp.sum(weighted, dtype=jnp.uint32), jnp.sum(mixed, dtype=jnp.uint32)]), finite


# Elements summed per NumPy pass: the pass's few uint32 temporaries stay in the cache, and a leaf of any
# size needs no memory beyond its host copy.
_HOST_CHUNK = 1 << 16


def _host_bits(flat: np.ndarray) -> np.ndarray:
    """[n] uint32 bit patterns of the [n] elements `flat`, or [2 n] for 64-bit ones, in `_bits`'s row-major order.

    Booleans (bytes 0 or 1) and other 8- and 16-bit elements are widened; a 64-bit element gives its low
    32 bits, then its high 32 bits, as XLA's bitcast_convert_type lays them out.
    """
    width = flat.dtype.itemsize
    if width == 8:
        wide = flat.view(np.uint64)
        return np.stack([wide.astype(np.uint32), (wide >> 32).astype(np.uint32)], axis=-1).reshape(-1)
    return flat.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[width]).astype(np.uint32, copy=False)


def _host_leaf_summary(x: np.ndarray) -> tuple[np.ndarray, bool]:
    """[2] uint32 fingerprint and 'finite' of a leaf in host memory: `_leaf_summary`'s values, with no program.

    `x` is first cast as jit casts its arguments (64-bit to 32-bit unless jax_enable_x64 is on), so that an
    array gets the fingerprint `_leaf_summary` gives it.
    """
    with np.errstate(over="ignore", invalid="ignore"):  # A float64 beyond float32, or a NaN: as jit casts it.
        flat = np.ascontiguousarray(x, dtype=jax.dtypes.canonicalize_dtype(x.dtype)).reshape(-1)
    inexact = jnp.issubdtype(flat.dtype, jnp.inexact)  # jnp's test: NumPy's does not count bfloat16.
    weighted = mixed = position = 0
    finite = True
    for start in range(0, flat.size, _HOST_CHUNK):
        chunk = flat[start : start + _HOST_CHUNK]
        bits = _host_bits(chunk)
        index = np.arange(bits.size, dtype=np.uint32) + np.uint32(position % 2**32)
        chunk_weighted, chunk_mixed = _terms(bits, index)
        weighted += int(np.sum(chunk_weighted, dtype=np.uint32))
        mixed += int(np.sum(chunk_mixed, dtype=np.uint32))
        position += bits.size
        if inexact and finite:
            with np.errstate(invalid="ignore"):  # ml_dtypes' bfloat16 warns at each NaN it is asked about.
                finite = bool(np.isfinite(chunk).all())
    return np.array([weighted % 2**32, mixed % 2**32], np.uint32), finite


def _summary(leaf: Any) -> tuple[np.ndarray, bool]:
    """[2] uint32 fingerprint and 'finite' of one leaf: in NumPy where this process holds all of it in host
    memory (a CPU's: no program to compile at a restore); jitted on the devices of a leaf spread over processes,
    or on an accelerator (no copy of a train state to the host, no sums at host speed)."""
    on_accelerator = isinstance(leaf, jax.Array) and any(device.platform != "cpu" for device in leaf.devices())
    if isinstance(leaf, jax.Array) and (not leaf.is_fully_addressable or on_accelerator):
        sums, finite = jax.device_get(_leaf_summary(leaf))
        return sums, bool(finite)
    return _host_leaf_summary(np.asarray(jax.device_get(leaf)))


class Summary:
    """A pytree's fingerprints by leaf name, and the names of its leaves that hold NaN or Inf."""

    def __init__(self, tree: Any):
        leaves = jax.tree.leaves(tree)
        # One leaf at a time: with leaves spread over processes each summary is a collective program, and
        # on a host with more (simulated) devices than cores, several in flight at once can hold every XLA
        # thread while each waits for the others (a rendezvous timeout). The arrays are few and small.
        summaries = [_summary(leaf) for leaf in leaves]
        sums, finite = zip(*summaries) if leaves else ((), ())
        names = leaf_names(tree)
        self.leaves = {
            name: {"dtype": str(np.dtype(leaf.dtype)), "weighted": int(pair[0]), "mixed": int(pair[1])}
            for name, leaf, pair in zip(names, leaves, sums)
        }
        self.nonfinite = [name for name, ok in zip(names, finite) if not ok]

    def record(self) -> dict:
        """The JSON saved with a checkpoint."""
        return {"version": FORMAT_VERSION, "method": METHOD, "leaves": self.leaves}

    def mismatches(self, recorded: dict) -> list[str]:
        """Names of this tree's leaves whose fingerprint differs from `recorded` (a `record()` read back).

        Leaves the record lacks, or saved with another dtype (restoring casts them), are not compared.
        """
        saved = recorded.get("leaves", {})
        return [
            name
            for name, now in self.leaves.items()
            if name in saved and saved[name]["dtype"] == now["dtype"] and saved[name] != now
        ]


class NonFiniteStateError(UserInputError):
    """A state or score holding NaN or Inf was about to be saved; nothing was written."""


def finite_summary(tree: Any, refusal: str) -> Summary:
    """`tree`'s Summary; if a leaf holds NaN or Inf, raises NonFiniteStateError: '<refusal> NaN or Inf in <leaf>...'."""
    summary = Summary(tree)
    if summary.nonfinite:
        raise NonFiniteStateError(
            f"{refusal} NaN or Inf in {some_names(summary.nonfinite)}. Nothing was written; the checkpoints "
            "on disk are intact. The run diverged: lower the learning rate and rerun (it resumes from the last "
            "checkpoint)."
        )
    return summary


def some_names(names: list[str]) -> str:
    """'a', 'a (and 1 more array)' or 'a (and 3 more arrays)'."""
    more = len(names) - 1
    return names[0] + (f" (and {more} more array{'s' if more > 1 else ''})" if more else "")
