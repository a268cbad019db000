"""The device mesh, logical-axis rules, and placement of batches and state on the mesh.

The mesh has three named axes (any may have size 1):
  data    splits the batch; parameters and optimizer state are replicated along it.
  fsdp    splits the batch too, and shards parameters and optimizer state (ZeRO-3 /
          fully sharded data parallel): each weight is gathered where it is used.
  tensor  splits attention heads, the feed-forward hidden units and the vocabulary
          (Megatron-style tensor parallelism); the batch is replicated along it.

Parameters name their dimensions with logical axes ('embed', 'heads', 'kv', 'mlp',
'vocab', 'norm'; see models/); batches are ('batch', 'length'). A rules table,
`config.mesh.rules`, maps logical axes to mesh axes, so changing how a model is
sharded is a config change, not code. `jax.jit` then compiles one SPMD program for
the shardings of its inputs (GSPMD inserts the collectives).

With several processes, the mesh spans the devices of all of them and every array
here is global: each process holds only the shards of its own devices, and builds
each batch from the rows it has read itself (`process_rows`, `shard_batch`).
"""

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from common.errors import UserInputError
from common.mesh_axes import (
    BATCH,
    BATCH_RULES,
    DATA_AXIS,
    FSDP_AXIS,
    MESH_AXES,
    TENSOR_AXIS,
    LogicalRules,
    logical_rules,
    mesh_axes_of,
    mesh_shape,
)


def make_mesh(mesh_config: ml_collections.ConfigDict | None = None, devices: Sequence[Any] | None = None) -> Mesh:
    """The (data, fsdp, tensor) mesh over `devices` (default: all); by default all of them on 'data'.

    `jax.make_mesh` orders the devices so that the last axes (tensor, then fsdp),
    whose collectives are the most frequent, connect the closest devices.
    """
    devices = list(devices if devices is not None else jax.devices())
    if mesh_config is None:
        mesh_config = ml_collections.ConfigDict({DATA_AXIS: -1, FSDP_AXIS: 1, TENSOR_AXIS: 1})
    shape = mesh_shape(mesh_config, len(devices))
    return jax.make_mesh(
        tuple(shape[axis] for axis in MESH_AXES),
        MESH_AXES,
        axis_types=(AxisType.Auto,) * len(MESH_AXES),
        devices=devices,
    )


def num_batch_shards(mesh: Mesh, rules: LogicalRules = BATCH_RULES) -> int:
    """Into how many parts a batch is split: the product of the mesh axes of 'batch'."""
    return int(np.prod([mesh.shape[axis] for axis in mesh_axes_of(BATCH, rules) if axis in mesh.shape]))


def batch_sharding(mesh: Mesh, rules: LogicalRules = BATCH_RULES) -> NamedSharding:
    """Splits the first dimension over the mesh axes of 'batch' that `mesh` has; replicates the rest."""
    axes = tuple(axis for axis in mesh_axes_of(BATCH, rules) if axis in mesh.axis_names)
    return NamedSharding(mesh, PartitionSpec(axes or None))


def without_unit_axes(sharding: NamedSharding) -> NamedSharding:
    """`sharding` without the mesh axes of size 1 in its spec: the sharding XLA gives a program's outputs (P('data')
    for P(('data', 'fsdp')) where fsdp is 1), so that arrays passed back in keep the program they came from."""

    def kept(entry):
        axes = tuple(
            axis for axis in (entry if isinstance(entry, tuple) else (entry,)) if sharding.mesh.shape.get(axis, 1) > 1
        )
        return None if not axes else axes[0] if len(axes) == 1 else axes

    return NamedSharding(sharding.mesh, PartitionSpec(*(kept(entry) for entry in sharding.spec)))


def decoding_cache_sharding(mesh: Mesh, rules: LogicalRules) -> NamedSharding:
    """Splits attention caches [rows, heads, length, d] as a batch by rows, and by heads as the attention's
    parameters are (the mesh axes of 'heads': the tensor axis), so that each device holds its own heads' keys."""
    rows = tuple(axis for axis in mesh_axes_of(BATCH, rules) if axis in mesh.axis_names)
    heads = tuple(axis for axis in mesh_axes_of("heads", rules) if axis in mesh.axis_names)
    return NamedSharding(mesh, PartitionSpec(rows or None, heads or None))


@functools.lru_cache(maxsize=64)
def _process_rows(global_rows: int, mesh: Mesh, rules: tuple) -> slice:
    index_map = batch_sharding(mesh, rules).addressable_devices_indices_map((global_rows,))
    ranges = sorted({index[0].indices(global_rows)[:2] for index in index_map.values()})
    start, stop = ranges[0][0], ranges[-1][1]
    if sum(b - a for a, b in ranges) != stop - start:
        raise ValueError(f"The devices of process {jax.process_index()} hold rows {ranges}, not one range.")
    return slice(start, stop)


def process_rows(global_rows: int, mesh: Mesh, rules: LogicalRules = BATCH_RULES) -> slice:
    """The rows of a [global_rows, ...] batch that this process's devices hold.

    Processes read and pad only these rows (`shard_batch` assembles the global
    batch). With the devices of each process adjacent on the batch axes, as
    `make_mesh` orders them, process p of n gets the p-th of n contiguous slices.

    Raises:
        ValueError: the devices of this process do not hold one contiguous range
            of rows (a mesh whose batch axes interleave processes).
    """
    return _process_rows(global_rows, mesh, logical_rules(rules))


def data_share(rows: slice, global_rows: int) -> tuple[int, int]:
    """(index, count) of the share of the training data that this process's `rows` (`process_rows`) read.

    One share per distinct range of rows: processes that hold the same rows (a batch not split
    over every process: a tensor axis, or rules that keep the batch off an axis, spanning
    processes) give the devices one replicated slice of the batch, so they must read the same
    records. With the batch split over every process, this is (process index, process count).
    """
    size = rows.stop - rows.start
    return rows.start // size, global_rows // size


def shard_batch(batch: dict[str, np.ndarray], mesh: Mesh, rules: LogicalRules = BATCH_RULES) -> dict[str, jax.Array]:
    """Global [global_batch, ...] arrays from this process's rows of each, split along the first axis as the rules say.

    Args:
        batch: this process's rows (`process_rows`) of every array; with one
            process, the whole batch.
        mesh: the device mesh (of every process).
        rules: the logical-axis rules; 'batch' gives the mesh axes of the first dimension.
    """
    return jax.make_array_from_process_local_data(batch_sharding(mesh, rules), batch)


def replicate(tree, mesh: Mesh):
    """Places a pytree on every device of `mesh`."""
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def shardings_from_boxes(boxed_tree: Any, mesh: Mesh, rules: LogicalRules) -> Any:
    """NamedShardings for a pytree whose leaves may be flax `LogicallyPartitioned` boxes.

    A boxed leaf is sharded as the rules map its logical axes; any other leaf
    (the step count, the RNG key, Adam's count) is replicated.

    Raises:
        UserInputError: a rule splits a dimension into parts that do not divide it.
    """
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed_tree), mesh, logical_rules(rules))
    abstract = nn.unbox(boxed_tree)
    for (path, leaf), sharding in zip(
        jax.tree_util.tree_leaves_with_path(abstract), jax.tree_util.tree_leaves(shardings), strict=True
    ):
        _check_divisible(jax.tree_util.keystr(path, simple=True, separator="/"), leaf.shape, sharding)
    return shardings


def _check_divisible(name: str, shape: tuple[int, ...], sharding: NamedSharding) -> None:
    for size, axes in zip(shape, sharding.spec, strict=False):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        parts = int(np.prod([sharding.mesh.shape[axis] for axis in axes]))
        if size % parts:
            raise UserInputError(
                f"Parameter {name} of shape {shape} cannot be split {parts} ways over mesh axes {axes} "
                f"(config.mesh.rules): {size} is not divisible by {parts}. Change the model size or the mesh."
            )


def with_shardings(abstract_tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `abstract_tree` carrying `shardings`: a restore target."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_tree, shardings)


def check_pmap(shape: dict[str, int]) -> None:
    """Raises UserInputError where config.step_compilation='pmap' cannot run: it is data parallel, in one process.

    Args:
        shape: the mesh's axis sizes (`mesh_shape`).
    """
    if shape[FSDP_AXIS] > 1 or shape[TENSOR_AXIS] > 1:
        raise UserInputError(
            "config.step_compilation='pmap' is data parallel only; set config.mesh.fsdp and config.mesh.tensor to 1 "
            "or use step_compilation='jit'."
        )
    if jax.process_count() > 1:
        raise UserInputError(
            f"config.step_compilation='pmap' runs in one process (its devices on one host); this run has "
            f"{jax.process_count()} processes: use step_compilation='jit', data parallel across all of them by default."
        )


def _pmap_stacked(mesh: Mesh, axis_name: str) -> NamedSharding:
    """A leading axis split over `mesh`'s devices as `jax.pmap(axis_name=...)` lays out its outputs, so that the
    state a step returns comes back in the layout of the first step's: the program is not compiled again."""
    return NamedSharding(Mesh(mesh.devices.reshape(-1), (axis_name,)), PartitionSpec(axis_name))


def stack_for_pmap(tree: Any, mesh: Mesh, axis_name: str) -> Any:
    """One copy of each array per device of `mesh`, stacked on a new leading axis, as `jax.pmap` takes them."""
    stacked = _pmap_stacked(mesh, axis_name)
    return jax.device_put(jax.tree.map(lambda x: jnp.broadcast_to(x, (mesh.size, *x.shape)), tree), stacked)


def unstack_from_pmap(tree: Any, mesh: Mesh) -> Any:
    """The first copy of each `pmap`-stacked array, replicated on `mesh` (copies are equal by construction)."""
    return replicate(jax.tree.map(lambda x: x[0], tree), mesh)


def split_for_pmap(batch: dict[str, np.ndarray], mesh: Mesh, axis_name: str) -> dict[str, jax.Array]:
    """Reshapes each [batch, ...] array to [devices, batch / devices, ...], one slice per device."""
    stacked = _pmap_stacked(mesh, axis_name)
    return jax.device_put({k: v.reshape(mesh.size, -1, *v.shape[1:]) for k, v in batch.items()}, stacked)
