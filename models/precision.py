"""Mixed-precision matmuls: operands in the compute dtype, products in float32.

Every matmul of the model goes through `float32_accumulating_einsum` (attention,
the tied output projection) or `float32_accumulating_dot_general` (passed to
`nn.Dense`/`nn.DenseGeneral`), so the precision policy lives in one place.
"""

import functools
import string
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array
Dtype = Any


# On CPUs with bf16 matrix units (AMX, AVX512-BF16) a bf16 x bf16 product is much
# faster than float32 -- but only when it accumulates into and returns float32.
# JAX's own gradient of such a product multiplies the float32 cotangent with the bf16
# operands, which XLA performs in float32; our backward pass instead casts the
# cotangent to the operand dtype (as bf16 training does anyway), so all three matmuls
# of a layer run in bf16. With float32 operands this is exactly the usual gradient.


def _materialized_transpose(x: Array, axes: list[int]) -> Array:
    if axes == sorted(axes):
        return x
    # The barrier stops XLA from folding the transpose back into the dot.
    return lax.optimization_barrier(jnp.transpose(x, axes))


def _matmul_einsum(subscripts: str, lhs: Array, rhs: Array) -> Array:
    """Two-operand einsum as [batch, m, k] x [batch, k, n] -> float32 [batch, m, n].

    Operands are explicitly transposed into this row-major matmul layout: XLA:CPU's
    fast bf16 kernels handle only it, other bf16 layouts are slow or unsupported.
    """
    operand_subscripts, out = subscripts.split('->')
    lhs_subscripts, rhs_subscripts = operand_subscripts.split(',')
    batch = [c for c in out if c in lhs_subscripts and c in rhs_subscripts]
    contracting = [c for c in lhs_subscripts if c in rhs_subscripts and c not in out]
    lhs_free = [c for c in lhs_subscripts if c not in rhs_subscripts]
    rhs_free = [c for c in rhs_subscripts if c not in lhs_subscripts]
    # Swap the operands when that makes the output need no transpose.
    if lhs_free and rhs_free and [c for c in out if c not in batch] == rhs_free + lhs_free:
        return _matmul_einsum(f'{rhs_subscripts},{lhs_subscripts}->{out}', rhs, lhs)
    lhs = _materialized_transpose(lhs, [lhs_subscripts.index(c) for c in batch + lhs_free + contracting])
    rhs = _materialized_transpose(rhs, [rhs_subscripts.index(c) for c in batch + contracting + rhs_free])
    num_batch, num_contracting = len(batch), len(contracting)
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
    product_subscripts = batch + lhs_free + rhs_free
    return jnp.transpose(product, [product_subscripts.index(c) for c in out])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _float32_output_einsum(subscripts: str, lhs: Array, rhs: Array) -> Array:
    return _matmul_einsum(subscripts, lhs, rhs)


def _float32_output_einsum_forward(subscripts, lhs, rhs):
    return _float32_output_einsum(subscripts, lhs, rhs), (lhs, rhs)


def _float32_output_einsum_backward(subscripts, residuals, cotangent):
    # For a product whose every operand index also appears in the other operand or the
    # output (true of any matmul), each operand's gradient is again an einsum.
    lhs, rhs = residuals
    operand_subscripts, out = subscripts.split('->')
    lhs_subscripts, rhs_subscripts = operand_subscripts.split(',')
    cotangent = cotangent.astype(lhs.dtype)
    lhs_grad = _matmul_einsum(f'{out},{rhs_subscripts}->{lhs_subscripts}', cotangent, rhs)
    rhs_grad = _matmul_einsum(f'{lhs_subscripts},{out}->{rhs_subscripts}', lhs, cotangent)
    return lhs_grad.astype(lhs.dtype), rhs_grad.astype(rhs.dtype)


_float32_output_einsum.defvjp(_float32_output_einsum_forward, _float32_output_einsum_backward)


def float32_accumulating_einsum(subscripts: str, lhs: Array, rhs: Array, *, dtype: Dtype) -> Array:
    """A two-operand matmul `jnp.einsum` of `lhs` and `rhs` cast to `dtype`, returning float32.

    Subscripts must be explicit ('...->...') without ellipses.
    """
    if dtype == jnp.float32 or jax.default_backend() != 'cpu':
        # GPU/TPU compilers pick fast layouts and mixed-precision gradients themselves.
        return jnp.einsum(subscripts, lhs.astype(dtype), rhs.astype(dtype), preferred_element_type=jnp.float32)
    return _float32_output_einsum(subscripts, lhs.astype(dtype), rhs.astype(dtype))


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
