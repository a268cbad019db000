"""The checkpoint fingerprint: its formula, and that it sees every flipped bit, swap and NaN."""

import jax.numpy as jnp
import numpy as np
import pytest

from training.checkpoints.integrity import Summary, leaf_names


def _mix(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer in NumPy (uint32 arithmetic wraps mod 2^32)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def _reference(x: np.ndarray) -> tuple[int, int]:
    """The module docstring's formulas, transcribed: sums over the flat uint32 bit patterns u_i."""
    width = x.dtype.itemsize
    bits = x.reshape(-1).view({1: np.uint8, 2: np.uint16, 4: np.uint32}[width]).astype(np.uint32)
    index = np.arange(bits.size, dtype=np.uint32)
    with np.errstate(over="ignore"):
        weighted = np.sum(bits * (np.uint32(2) * index + np.uint32(1)), dtype=np.uint32)
        mixed = np.sum(_mix(bits ^ _mix(index)), dtype=np.uint32)
    return int(weighted), int(mixed)


def _fingerprint(x) -> tuple[int, int]:
    record = Summary({"x": x}).leaves["x"]
    return record["weighted"], record["mixed"]


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.uint32, jnp.bfloat16, np.float16, np.int8])
def test_fingerprint_is_the_documented_formula(dtype):
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(3, 5, 7)) * 50).astype(dtype)
    assert _fingerprint(jnp.asarray(x)) == _reference(x)


def test_every_flipped_bit_changes_both_sums():
    x = np.random.default_rng(1).normal(size=(4, 6)).astype(np.float32)
    original = _fingerprint(x)
    bits = x.view(np.uint32)
    for position in (0, 7, 23):
        for bit in range(32):
            flipped = bits.copy()
            flipped.reshape(-1)[position] ^= np.uint32(1 << bit)
            weighted, mixed = _fingerprint(flipped.view(np.float32))
            assert weighted != original[0] and mixed != original[1], (position, bit)


def test_swapped_elements_change_the_fingerprint():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    swapped = x.copy()
    swapped[0, 1], swapped[2, 3] = x[2, 3], x[0, 1]
    transposed_layout = x.T.copy().reshape(3, 4)  # The same values in another order.
    assert len({_fingerprint(x), _fingerprint(swapped), _fingerprint(transposed_layout)}) == 3


def test_nonfinite_leaves_are_named_and_mismatches_compared_by_name():
    tree = {"a": np.ones((2,), np.float32), "b": {"c": np.array([1.0, np.nan], np.float32)}, "n": np.arange(3)}
    summary = Summary(tree)
    assert leaf_names(tree) == ["a", "b/c", "n"]
    assert summary.nonfinite == ["b/c"]

    recorded = summary.record()
    changed = Summary({"a": np.ones((2,), np.float32), "b": {"c": np.zeros((2,), np.float32)}, "n": np.arange(3)})
    assert changed.mismatches(recorded) == ["b/c"]
    assert Summary({"a": tree["a"]}).mismatches(recorded) == []  # Only the leaves restored are compared.
