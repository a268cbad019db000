"""models/precision.py: the mixed-precision policy, checked in the compiled train step itself."""

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import pretend_gpu
from tolerances import rounding_tolerance

from configs import default
from models import build, precision
from models.build import make_model
from training.state import create_train_state
from training.steps import train_step, translation_loss

# `stablehlo.dot_general %a, %b, ... : (tensor<...xbf16>, tensor<...xbf16>) -> tensor<...xf32>`
DOT_GENERAL = re.compile(
    r"stablehlo\.dot_general .*: \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\) -> tensor<[^>]*x(\w+)>"
)


# `%dot.3 = f32[...] dot(%lhs, %rhs), ...` in an optimized (compiled) HLO module.
COMPILED_DOT = re.compile(r" dot\(%([\w.]+), %([\w.]+)\)")


# Forward: per encoder layer 4 projections, 2 attention products and 2 feed-forward layers;
# per decoder layer twice the attention; the output projection. Backward: two per matmul.
MATMULS_PER_STEP = 3 * (2 * (4 + 2 + 2) + 2 * (2 * (4 + 2) + 2) + 1)


def _lowered_train_step(dtype: str) -> jax.stages.Lowered:
    """A whole train step (forward, backward, Adam) of a small model computing in `dtype`, lowered."""
    config = default.get_config()
    config.model.update(d_model=32, num_heads=4, d_ff=64, num_layers=2, dropout_rate=0.1, max_len=16, dtype=dtype)
    model = make_model(config, vocab_size=24)
    tx = optax.adam(1e-3)
    state = jax.eval_shape(lambda: create_train_state(model, tx, seed=0))  # Lowering reads its shapes alone.
    batch = {"inputs": np.ones((4, 16), np.int32), "targets": np.ones((4, 16), np.int32)}
    step = functools.partial(
        train_step,
        loss_fn=functools.partial(translation_loss, model=model, label_smoothing=0.1),
        tx=tx,
        learning_rate_fn=lambda count: 1e-3,
    )
    return jax.jit(step).lower(state, batch, jax.random.key(0))


@pytest.mark.parametrize("explicit_layouts", [True, False], ids=["cpu_branch", "gpu_tpu_branch"])
def test_every_matmul_of_the_bfloat16_train_step_takes_bfloat16_and_accumulates_in_float32(
    monkeypatch, explicit_layouts
):
    # The GPU/TPU branch (XLA lays out the matmuls) is forced here on the CPU.
    monkeypatch.setattr(precision, "_explicit_row_major_layouts", lambda: explicit_layouts)
    dots = DOT_GENERAL.findall(_lowered_train_step("bfloat16").as_text())
    assert len(dots) == MATMULS_PER_STEP
    assert all(dot == ("bf16", "bf16", "f32") for dot in dots), sorted(set(dots))


def _compiled_products(hlo: str) -> collections.Counter:
    """(batched or not, lhs dtype, rhs dtype) of every dot of an optimized HLO module, counted."""
    products = collections.Counter()
    for line in hlo.splitlines():
        dot = COMPILED_DOT.search(line)
        if dot:
            lhs, rhs = (re.search(rf"%{re.escape(name)}(?: =|:) (\w+)\[", hlo).group(1) for name in dot.groups())
            products["batched" if "lhs_batch_dims" in line else "2d", lhs, rhs] += 1
    return products


@pytest.mark.skipif(build.compute_dtype("auto") != "bfloat16", reason="a CPU without bf16 matmul instructions")
def test_xla_cpu_runs_attentions_batched_products_in_bfloat16_as_the_others():
    # XLA:CPU converts a bf16 product back to float32 where its kernels do not take the operands' layout:
    # before their batch dimensions were merged, it did so for all 36 of attention's (and for none of the
    # 2D ones), which took attention's core 30% longer (models/precision.py).
    products = _compiled_products(_lowered_train_step("bfloat16").compile().as_text())
    assert products == {("2d", "bf16", "bf16"): MATMULS_PER_STEP - 36, ("batched", "bf16", "bf16"): 36}


def test_a_float32_model_multiplies_in_float32():
    dots = DOT_GENERAL.findall(_lowered_train_step("float32").as_text())
    assert len(dots) == MATMULS_PER_STEP
    assert all(dot == ("f32", "f32", "f32") for dot in dots), sorted(set(dots))


@pytest.mark.parametrize(
    "subscripts, lhs_shape, rhs_shape",
    [
        ("bld,vd->blv", (2, 3, 8), (11, 8)),  # Tied output projection.
        ("blv,vd->bld", (2, 3, 11), (11, 8)),  # Its input gradient.
        ("bld,blv->vd", (2, 3, 8), (2, 3, 11)),  # Its weight gradient: operands swapped.
        ("bqhd,bkhd->bhqk", (2, 5, 3, 4), (2, 6, 3, 4)),  # Attention logits.
        ("bhqk,bkhd->bqhd", (2, 3, 5, 6), (2, 6, 3, 4)),  # Attention-weighted values.
        ("abc,cde->abde", (2, 3, 4), (4, 5, 6)),  # nn.DenseGeneral to heads.
    ],
)
def test_row_major_matmul_equals_einsum(subscripts, lhs_shape, rhs_shape):
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.normal(size=lhs_shape), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=rhs_shape), jnp.float32)
    contracted = int(
        np.prod(
            [lhs_shape[subscripts.index(c)] for c in subscripts.split(",")[0] if c not in subscripts.split("->")[1]]
        )
    )
    np.testing.assert_allclose(
        precision._row_major_matmul(subscripts, lhs, rhs),
        np.einsum(subscripts, np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)),
        atol=rounding_tolerance(contracted, magnitude=4.0 * contracted),
    )


def test_the_cheaper_operand_order_is_taken():
    # The output projection's weight gradient: transposing the [batch, length, vocab]
    # cotangent would move 10x more than transposing the hidden states and the
    # [d_model, vocab] product.
    hidden, cotangent = jnp.ones((4, 16, 8)), jnp.ones((4, 16, 400))
    as_written = precision._transposed_elements("bld,blv->vd", hidden, cotangent)
    swapped = precision._transposed_elements("blv,bld->vd", cotangent, hidden)
    assert as_written == hidden.size + 8 * 400
    assert swapped == cotangent.size
    for operands in [(hidden, cotangent), (cotangent, hidden)]:  # Either way round, the same layout.
        subscripts = "bld,blv->vd" if operands[0] is hidden else "blv,bld->vd"
        lowered = jax.jit(functools.partial(precision._row_major_matmul, subscripts)).lower(*operands).as_text()
        assert "tensor<8x4x16xf32>" in lowered  # The hidden states as [d_model, batch, length].
        assert "tensor<400x4x16xf32>" not in lowered  # The cotangent stays as it is.


@pytest.mark.parametrize(
    "cpu, expected",
    [
        ("flags\t\t: fpu sse2 avx avx2 fma", "float32"),  # bf16 matmuls emulated: slower than float32.
        ("flags\t\t: fpu avx2 avx512f avx512_bf16", "bfloat16"),
        ("flags\t\t: fpu avx512f amx_bf16 amx_tile", "bfloat16"),
        ("Features\t: fp asimd bf16 i8mm", "bfloat16"),  # Arm.
        ("Features\t: fp asimd", "float32"),
    ],
)
def test_auto_dtype_is_bfloat16_where_the_cpu_multiplies_bfloat16(tmp_path, cpu, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\n{cpu}\n\nprocessor\t: 1\n{cpu}\n", encoding="utf-8")
    assert build.compute_dtype("auto", str(cpuinfo)) == expected
    assert build.compute_dtype("float32", str(cpuinfo)) == "float32"  # What a config names stands.
    assert build.compute_dtype("auto", str(tmp_path / "absent")) == "float32"  # No flags to read.


def test_auto_dtype_on_accelerators_and_in_the_model(monkeypatch):
    config = default.get_config()
    assert make_model(config, vocab_size=24).config.dtype == build.compute_dtype("auto")
    pretend_gpu(monkeypatch, compute_capability="9.0")  # An H100.
    assert build.compute_dtype("auto", "/proc/cpuinfo") == "bfloat16"
    assert make_model(config, vocab_size=24).config.dtype == "bfloat16"
    pretend_gpu(monkeypatch, compute_capability="7.0")  # A V100.
    assert build.compute_dtype("auto", "/proc/cpuinfo") == "float32"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert build.compute_dtype("auto", "/proc/cpuinfo") == "bfloat16"
