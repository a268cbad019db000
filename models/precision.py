"""Mixed-precision matmuls: operands in the compute dtype, products in float32.

Every matmul of the model goes through `float32_accumulating_einsum` (attention,
the tied output projection) or `float32_accumulating_dot_general` (passed to
`nn.Dense`/`nn.DenseGeneral`), so the precision policy lives in one place.
"""

import functools
import math
import string
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array
Dtype = Any


# Policy: with a bf16 compute dtype, every matmul of the forward and the backward pass takes
# bf16 operands and accumulates (and returns) float32, on every backend. JAX's own gradient of
# such a product would multiply the float32 cotangent with the bf16 operands, which XLA runs
# in float32 (at float32/TF32 speed on GPU, in slow float32 kernels on CPU); the custom
# gradient below casts the cotangent to the operand dtype first, as bf16 training does anyway.
# With float32 operands this is exactly the usual gradient.


def _explicit_row_major_layouts() -> bool:
    """Whether matmuls are laid out by hand as [batch, m, k] x [batch, k, n] (XLA:CPU), not by XLA."""
    return jax.default_backend() == 'cpu'


def _transposed_operand(x: Array, axes: list[int]) -> Array:
    """`x` transposed to `axes` in memory, for a dot to read as it is."""
    if axes == sorted(axes):
        return x
    # The barrier stops XLA from folding the transpose back into the dot (whatever makes
    # `x`, a cast for one, may still fuse into the transpose).
    return lax.optimization_barrier(jnp.transpose(x, axes))


def _transposed_product(product: Array, axes: list[int]) -> Array:
    """A dot's `product` transposed to `axes`, the dot kept in the row-major layout."""
    if axes == sorted(axes):
        return product
    # The barrier stops XLA from turning transpose(dot) into a dot of transposed operands
    # (which XLA:CPU cannot run in bf16); the transpose may fuse into what uses it.
    return jnp.transpose(lax.optimization_barrier(product), axes)


def _row_major_layout(subscripts: str) -> tuple[list[str], list[str], list[str], list[str], list[str]]:
    """(batch, contracting, lhs_free, rhs_free, out) letters of a two-operand einsum."""
    operand_subscripts, out = subscripts.split('->')
    lhs_subscripts, rhs_subscripts = operand_subscripts.split(',')
    batch = [c for c in out if c in lhs_subscripts and c in rhs_subscripts]
    contracting = [c for c in lhs_subscripts if c in rhs_subscripts and c not in out]
    lhs_free = [c for c in lhs_subscripts if c not in rhs_subscripts]
    rhs_free = [c for c in rhs_subscripts if c not in lhs_subscripts]
    return batch, contracting, lhs_free, rhs_free, list(out)


def _transposed_elements(subscripts: str, lhs: Array, rhs: Array) -> int:
    """How many elements `_row_major_matmul` moves to lay out `subscripts` with these operands."""
    batch, contracting, lhs_free, rhs_free, out = _row_major_layout(subscripts)
    lhs_subscripts, rhs_subscripts = subscripts.split('->')[0].split(',')
    sizes = dict(zip(lhs_subscripts, lhs.shape)) | dict(zip(rhs_subscripts, rhs.shape))
    moved = 0
    if list(lhs_subscripts) != batch + lhs_free + contracting:
        moved += lhs.size
    if list(rhs_subscripts) != batch + contracting + rhs_free:
        moved += rhs.size
    if out != batch + lhs_free + rhs_free:
        moved += math.prod(sizes[c] for c in out)
    return moved


def _row_major_matmul(subscripts: str, lhs: Array, rhs: Array) -> Array:
    """Two-operand einsum as [batch, m, k] x [batch, k, n] -> float32 [batch, m, n].

    Operands are explicitly transposed into this row-major matmul layout: XLA:CPU's
    fast bf16 kernels handle only it, other bf16 layouts are slow or unsupported, and
    its float32 kernels run faster in it too. Of
    the two operand orders, the one that moves fewer elements is taken: the gradient
    of the output projection, for one, transposes its small [d_model, vocab] result
    rather than its large [tokens, vocab] cotangent. Several batch dimensions (attention's
    rows and heads) are merged into one: with two, XLA:CPU converted all of attention's
    bf16 products back to float32 when it compiled the train step, and attention's core,
    forward and backward, ran slower than in bf16 (tests/test_precision.py checks that
    every product stays bf16).
    """
    operand_subscripts, out = subscripts.split('->')
    lhs_subscripts, rhs_subscripts = operand_subscripts.split(',')
    swapped = f'{rhs_subscripts},{lhs_subscripts}->{out}'
    if _transposed_elements(swapped, rhs, lhs) < _transposed_elements(subscripts, lhs, rhs):
        subscripts, lhs, rhs = swapped, rhs, lhs
        lhs_subscripts, rhs_subscripts = rhs_subscripts, lhs_subscripts
    batch, contracting, lhs_free, rhs_free, out = _row_major_layout(subscripts)
    lhs = _transposed_operand(lhs, [lhs_subscripts.index(c) for c in batch + lhs_free + contracting])
    rhs = _transposed_operand(rhs, [rhs_subscripts.index(c) for c in batch + contracting + rhs_free])
    batch_shape = lhs.shape[: len(batch)]
    if len(batch) > 1:
        lhs = lhs.reshape(math.prod(batch_shape), *lhs.shape[len(batch) :])
        rhs = rhs.reshape(math.prod(batch_shape), *rhs.shape[len(batch) :])
    num_batch, num_contracting = (1 if batch else 0), len(contracting)  # Batch dimensions now merged.
    product = lax.dot_general(
        lhs,
        rhs,
        (
            (
                tuple(range(lhs.ndim - num_contracting, lhs.ndim)),
                tuple(range(num_batch, num_batch + num_contracting)),
            ),
            (tuple(range(num_batch)), tuple(range(num_batch))),
        ),
        preferred_element_type=jnp.float32,
    )
    product = product.reshape(*batch_shape, *product.shape[num_batch:])
    product_subscripts = batch + lhs_free + rhs_free
    return _transposed_product(product, [product_subscripts.index(c) for c in out])


def _matmul(subscripts: str, lhs: Array, rhs: Array) -> Array:
    """The einsum of two same-dtype operands, accumulated in and returned as float32."""
    if _explicit_row_major_layouts():
        return _row_major_matmul(subscripts, lhs, rhs)
    return jnp.einsum(subscripts, lhs, rhs, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _float32_output_einsum(subscripts: str, lhs: Array, rhs: Array) -> Array:
    return _matmul(subscripts, lhs, rhs)


def _float32_output_einsum_forward(subscripts, lhs, rhs):
    return _float32_output_einsum(subscripts, lhs, rhs), (lhs, rhs)


def _float32_output_einsum_backward(subscripts, residuals, cotangent):
    # For a product whose every operand index also appears in the other operand or the
    # output (true of any matmul), each operand's gradient is again an einsum.
    lhs, rhs = residuals
    operand_subscripts, out = subscripts.split('->')
    lhs_subscripts, rhs_subscripts = operand_subscripts.split(',')
    cotangent = cotangent.astype(lhs.dtype)
    lhs_grad = _matmul(f'{out},{rhs_subscripts}->{lhs_subscripts}', cotangent, rhs)
    rhs_grad = _matmul(f'{lhs_subscripts},{out}->{rhs_subscripts}', lhs, cotangent)
    return lhs_grad.astype(lhs.dtype), rhs_grad.astype(rhs.dtype)


_float32_output_einsum.defvjp(_float32_output_einsum_forward, _float32_output_einsum_backward)


def float32_accumulating_einsum(subscripts: str, lhs: Array, rhs: Array, *, dtype: Dtype) -> Array:
    """A two-operand matmul `jnp.einsum` of `lhs` and `rhs` cast to `dtype`, returning float32.

    Forward and backward products take `dtype` operands and accumulate in float32.
    Subscripts must be explicit ('...->...') without ellipses.
    """
    lhs, rhs = lhs.astype(dtype), rhs.astype(dtype)
    if dtype == jnp.float32 and not _explicit_row_major_layouts():
        # JAX's own gradient is float32 throughout; XLA picks the layouts.
        return jnp.einsum(subscripts, lhs, rhs, preferred_element_type=jnp.float32)
    return _float32_output_einsum(subscripts, lhs, rhs)


def _dot_general_subscripts(lhs_ndim: int, rhs_ndim: int, dimension_numbers) -> str:
    """The einsum equivalent of `lax.dot_general` dimension numbers, e.g. 'abc,cd->abd'."""
    (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = dimension_numbers
    letters = iter(string.ascii_letters)
    lhs = [next(letters) for _ in range(lhs_ndim)]
    rhs = [next(letters) for _ in range(rhs_ndim)]
    for lhs_axis, rhs_axis in zip((*lhs_contracting, *lhs_batch), (*rhs_contracting, *rhs_batch)):
        rhs[rhs_axis] = lhs[lhs_axis]
    lhs_free = [lhs[i] for i in range(lhs_ndim) if i not in (*lhs_contracting, *lhs_batch)]
    rhs_free = [rhs[i] for i in range(rhs_ndim) if i not in (*rhs_contracting, *rhs_batch)]
    out = [lhs[i] for i in lhs_batch] + lhs_free + rhs_free  # dot_general's output order.
    return f"{''.join(lhs)},{''.join(rhs)}->{''.join(out)}"


def float32_accumulating_dot_general(
    lhs: Array, rhs: Array, dimension_numbers, precision=None, preferred_element_type=None
) -> Array:
    """Drop-in `lax.dot_general` for `nn.Dense(dot_general=...)`: always returns float32.

    Dense casts its inputs and kernel to its `dtype` before calling this, so with
    dtype=bfloat16 this is a fast bf16 x bf16 -> f32 product (backward pass included).
    """
    del precision, preferred_element_type  # Default precision; always float32 output.
    subscripts = _dot_general_subscripts(lhs.ndim, rhs.ndim, dimension_numbers)
    return float32_accumulating_einsum(subscripts, lhs, rhs, dtype=lhs.dtype)
