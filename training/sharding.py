"""Device mesh and placement: the batch is split over the 'data' axis, the state replicated.

With several processes, the mesh spans the devices of all of them and every
array here is global: each process holds only the shards of its own devices.
A batch is built from the rows each process has read itself
(`process_rows`, `shard_batch`).
"""

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"
BATCH_SPEC = PartitionSpec(DATA_AXIS)  # [batch, ...] arrays: rows split over the data axis.


def make_mesh() -> Mesh:
    """A 1-D data-parallel mesh over every device (of every process)."""
    return Mesh(np.asarray(jax.devices()), (DATA_AXIS,))


def replicate(tree, mesh: Mesh):
    """Places a pytree on every device of `mesh` (every process must pass the same values)."""
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


@functools.lru_cache(maxsize=64)
def process_rows(global_rows: int, mesh: Mesh, spec: PartitionSpec = BATCH_SPEC) -> slice:
    """The rows of a [global_rows, ...] batch that this process's devices hold under `spec`.

    Processes read and pad only these rows (`shard_batch` assembles the global
    batch). With devices ordered by process, as in `make_mesh`, process p of n
    gets the p-th of n contiguous slices.

    Raises:
        ValueError: the devices of this process do not hold one contiguous
            range of rows (a mesh whose data axis interleaves processes).
    """
    index_map = NamedSharding(mesh, spec).addressable_devices_indices_map((global_rows,))
    ranges = sorted({index[0].indices(global_rows)[:2] for index in index_map.values()})
    start, stop = ranges[0][0], ranges[-1][1]
    covered = sum(b - a for a, b in ranges)
    if covered != stop - start:
        raise ValueError(f"The devices of process {jax.process_index()} hold rows {ranges}, not one range.")
    return slice(start, stop)


def shard_batch(batch: dict[str, np.ndarray], mesh: Mesh, spec: PartitionSpec = BATCH_SPEC) -> dict[str, jax.Array]:
    """Global [global_batch, ...] arrays from this process's rows of each array.

    Args:
        batch: this process's rows (`process_rows`) of every array; with one
            process, the whole batch.
        mesh: the device mesh.
        spec: how the global arrays are split over the mesh.

    Returns:
        Global arrays split along their first axis as `spec` says.
    """
    return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), batch)


def abstract_like(tree, mesh: Mesh):
    """ShapeDtypeStructs of `tree` (arrays or structs), replicated on `mesh`: a restore target."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), tree)
