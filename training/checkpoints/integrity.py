"""Fingerprints of a pytree's array contents, to tell a restored checkpoint from a silently damaged one.

A checkpoint records, per leaf, two 32-bit sums of the leaf's bits, computed on the device where the
arrays live (jitted, no copy to the host); restoring recomputes them for the leaves read back
and compares. For a leaf with bit patterns u_i (its elements bitcast to uint32, flat index i):

  weighted = sum_i (2 i + 1) * u_i         mod 2^32
  mixed    = sum_i mix(u_i XOR mix(i))     mod 2^32    (mix: MurmurHash3's 32-bit finalizer, a bijection)

A flipped bit changes `weighted` by an odd multiple of a power of two below 2^32, so never by 0 mod 2^32;
any change of one element changes `mixed` (mix is a bijection); swapped elements change both. Several
changes cancel in both sums with probability about 2^-64. Sums mod 2^32 do not depend on the order of
the reduction, so the fingerprint is the same on any mesh and any number of processes, and the result
of the global reduction is replicated: every process sees the same verdict.

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


def _mix(x: jax.Array) -> jax.Array:
    """MurmurHash3's finalizer on uint32: a bijection that spreads every input bit over the output."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


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
    """[2] uint32 fingerprint and [] bool 'finite' of one leaf.

    Compiled per leaf shape, dtype and sharding: a model repeats a few shapes across its layers,
    and one program over all leaves of a large state is slow to compile.
    """
    bits = _bits(x)
    index = _flat_index(bits.shape)
    weighted = jnp.sum(bits * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)
    mixed = jnp.sum(_mix(bits ^ _mix(index)), dtype=jnp.uint32)
    finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.array(True)
    return jnp.stack([weighted, mixed]), finite


class Summary:
    """A pytree's fingerprints by leaf name, and the names of its leaves that hold NaN or Inf."""

    def __init__(self, tree: Any):
        leaves = jax.tree.leaves(tree)
        # One leaf at a time: with sharded leaves each summary is a collective program, and on a host
        # with more (simulated) devices than cores, several in flight at once can hold every XLA
        # thread while each waits for the others (a rendezvous timeout). The arrays are few and small.
        summaries = [jax.device_get(_leaf_summary(leaf)) for leaf in leaves]
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
