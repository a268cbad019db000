"""Device mesh and placement: the batch is split over the 'data' axis, the state replicated."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"


def make_mesh() -> Mesh:
    """A 1-D data-parallel mesh over every device."""
    return Mesh(np.asarray(jax.devices()), (DATA_AXIS,))


def replicate(tree, mesh: Mesh):
    """Places a pytree on every device of `mesh`."""
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def shard_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Splits each [batch, ...] array along its first axis over the data axis."""
    return jax.device_put(batch, NamedSharding(mesh, PartitionSpec(DATA_AXIS)))


def abstract_like(tree, mesh: Mesh):
    """ShapeDtypeStructs of `tree` (arrays or structs), replicated on `mesh`: a restore target."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), tree)
