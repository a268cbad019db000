"""The checkpoint fingerprint: its formula, the same in NumPy as jitted, no program at a restore, and that it sees
every flipped bit, swap and NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compiled_programs
from jax.sharding import NamedSharding, PartitionSpec

from training.checkpoints import integrity
from training.checkpoints.checkpointer import Checkpointer
from training.checkpoints.integrity import Summary, leaf_names
from training.runtime import sharding
from training.state import TrainState


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


def _random_leaf(dtype, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random bit patterns of `dtype` (NaNs, infinities and subnormals among the floats); booleans 0 or 1."""
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    raw = rng.integers(0, 256, size=(*shape, np.dtype(dtype).itemsize), dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def _jitted(x) -> tuple[tuple[int, int], bool]:
    sums, finite = jax.device_get(integrity._leaf_summary(x))
    return (int(sums[0]), int(sums[1])), bool(finite)


def _on_host(x) -> tuple[tuple[int, int], bool]:
    sums, finite = integrity._host_leaf_summary(x)
    return (int(sums[0]), int(sums[1])), finite


# 0-d, empty, odd sizes, and more elements than a NumPy pass takes (2^16), so that passes join.
SHAPES = [(), (0,), (4, 0, 3), (1,), (7,), (3, 5, 7), (257, 259)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16, np.int32, np.int8, np.bool_, np.uint32])
def test_the_numpy_fingerprint_is_the_jitted_one(dtype, shape):
    assert integrity._HOST_CHUNK < 257 * 259
    x = _random_leaf(dtype, shape, seed=len(shape))
    assert _on_host(x) == _jitted(jnp.asarray(x))


@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 5, 7), (181, 191)], ids=str)
@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.uint64])
def test_the_numpy_fingerprint_of_64_bit_leaves_is_the_jitted_one(dtype, shape):
    x = _random_leaf(dtype, shape, seed=1)
    with jax.enable_x64(True):  # 64-bit arrays exist in JAX only so; each element is two words (low, high).
        assert _on_host(x) == _jitted(jnp.asarray(x))
    # Without x64, jit takes a 64-bit NumPy leaf as 32-bit, and so does the fingerprint (records stay as they were).
    with np.errstate(over="ignore", invalid="ignore"):  # jit's cast of float64s beyond float32 warns.
        assert _on_host(x) == _jitted(x)


def test_a_restore_compiles_no_program(tmp_path):
    rng = np.random.default_rng(2)
    params = {
        "kernel": rng.normal(size=(32, 48)).astype(np.float32),
        "bias": rng.normal(size=(47,)).astype(np.float32),
        "table": rng.normal(size=(5, 3)).astype(jnp.bfloat16),
    }
    mesh = sharding.make_mesh()
    state = TrainState(step=jnp.array(3, jnp.int32), params=params, opt_state=(), rng=jax.random.PRNGKey(0))
    checkpointer = Checkpointer(str(tmp_path))
    checkpointer.save(sharding.replicate(state, mesh), {})
    checkpointer.close()
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), params)

    jax.clear_caches()  # Programs of the save, or of other tests, would otherwise be reused without a compile.
    with compiled_programs() as programs:
        checkpointer = Checkpointer(str(tmp_path), read_only=True)
        restored, _ = checkpointer.load_params("latest", abstract)
        checkpointer.close()
    assert programs == []
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), params)
