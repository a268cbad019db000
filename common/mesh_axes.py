"""The mesh's axis names, and how a config's mesh and logical-axis rules map onto them.

Pure functions of the config: `check_mesh` checks a mesh with them before any device exists,
training/runtime/sharding.py builds the mesh and places arrays with them.
"""

from collections.abc import Mapping, Sequence

import flax.linen as nn
import ml_collections
import numpy as np

from common.errors import UserInputError

DATA_AXIS, FSDP_AXIS, TENSOR_AXIS = "data", "fsdp", "tensor"
MESH_AXES = (DATA_AXIS, FSDP_AXIS, TENSOR_AXIS)
BATCH = "batch"  # The logical axis of a batch's first dimension.

LogicalRules = Sequence[tuple[str, str | Sequence[str] | None]]

# The batch rule of configs/default.py, for callers that place batches without a
# config (evaluation): split over every axis that splits the batch.
BATCH_RULES: LogicalRules = ((BATCH, (DATA_AXIS, FSDP_AXIS)),)


def mesh_shape(mesh_config: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
    """{'data': d, 'fsdp': f, 'tensor': t} with d * f * t == num_devices; one size may be -1 (the rest).

    Raises:
        UserInputError: the sizes do not multiply to the device count.
    """
    sizes = {axis: int(mesh_config[axis]) for axis in MESH_AXES}
    fill = [axis for axis, size in sizes.items() if size == -1]
    described = ", ".join(f"{axis}={size}" for axis, size in sizes.items())
    if len(fill) > 1 or any(size == 0 or size < -1 for size in sizes.values()):
        raise UserInputError(
            f"config.mesh ({described}) must have positive axis sizes, at most one of them -1 (the remaining devices)."
        )
    fixed = int(np.prod([size for size in sizes.values() if size != -1]))
    if fill and num_devices % fixed == 0:
        sizes[fill[0]] = num_devices // fixed
    if int(np.prod(list(sizes.values()))) != num_devices:
        raise UserInputError(
            f"config.mesh ({described}) does not fit the {num_devices} devices: the axis sizes must multiply "
            f"to {num_devices} (set one of them to -1 to take the remaining devices)."
        )
    return sizes


def logical_rules(rules: LogicalRules) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """The config's rules as flax expects them: hashable tuples, lists made tuples."""
    return tuple((name, tuple(axes) if isinstance(axes, list | tuple) else axes) for name, axes in rules)


def mesh_axes_of(logical_axis: str, rules: LogicalRules) -> tuple[str, ...]:
    """The mesh axes a logical axis is split over (empty: replicated)."""
    spec = nn.logical_to_mesh_axes((logical_axis,), logical_rules(rules))[0]
    if spec is None:
        return ()
    return tuple(spec) if isinstance(spec, tuple) else (spec,)


def check_mesh(
    mesh_config: ml_collections.ConfigDict, num_devices: int, sizes: Mapping[str, Sequence[tuple[str, int]]]
) -> dict[str, int]:
    """The mesh's shape (`mesh_shape`), once its rules are well formed and split every size evenly.

    Args:
        mesh_config: config.mesh.
        num_devices: the devices the mesh spans.
        sizes: logical axis -> (subject, size) for each size the model gives it, where `subject`
            begins the error ("config.model.d_model (512) is").

    Raises:
        UserInputError: the mesh does not fit the devices, a rule is malformed or names an
            unknown mesh axis, or a rule splits a size into parts that do not divide it.
    """
    shape = mesh_shape(mesh_config, num_devices)
    rules = mesh_config.rules
    try:
        for axis in (BATCH, *sizes):
            mesh_axes_of(axis, rules)
    except (TypeError, ValueError):
        raise UserInputError(
            f"config.mesh.rules {rules!r} must be pairs (logical axis, mesh axis or tuple of mesh axes or None)."
        ) from None
    for name, mesh_axes in logical_rules(rules):
        unknown = set((mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes or ()) - set(MESH_AXES)
        if unknown:
            raise UserInputError(f"config.mesh.rules maps {name!r} to {sorted(unknown)}; mesh axes are {MESH_AXES}.")
    described = ", ".join(f"{axis}={size}" for axis, size in shape.items())
    for logical_axis, subjects in sizes.items():
        mesh_axes = mesh_axes_of(logical_axis, rules)
        parts = int(np.prod([shape[axis] for axis in mesh_axes]))
        for subject, size in subjects:
            if size % parts:
                raise UserInputError(
                    f"{subject} not divisible by {parts}, the size of mesh axes {mesh_axes} that config.mesh.rules "
                    f"split {logical_axis!r} over; change the model or the mesh ({described})."
                )
    return shape
