"""benchmarks/xla_profile.py sums a trace's instruction times by bucket: a CPU trace's threads, a GPU trace's kernels."""

# ruff: noqa: E501  (the module below is written as XLA prints it: one instruction a line)

import math

import jax
import jax.numpy as jnp
import pytest

from benchmarks import hlo_buckets, xla_profile

_OP = "jit(train_step)/transpose(jvp(Transformer))/Transformer.decode/decoder/layers_0"
# A compiled GPU module as XLA:GPU prints it: a cuBLAS matmul, cuDNN's fused attention, a fusion.
_GPU_HLO = f"""
%fused_multiply.2 (param_0.2: f32[8,6]) -> f32[8,6] {{
  %param_0.2 = f32[8,6]{{1,0}} parameter(0)
  ROOT %multiply.2 = f32[8,6]{{1,0}} multiply(%param_0.2, %param_0.2), metadata={{op_name="{_OP}/feed_forward_norm/mul"}}
}}

ENTRY %main.9 (p0: bf16[8,4], p1: bf16[4,6]) -> f32[8,6] {{
  %p0 = bf16[8,4]{{1,0}} parameter(0)
  %p1 = bf16[4,6]{{1,0}} parameter(1)
  %custom-call.3 = (f32[8,6]{{1,0}}, s8[0]{{0}}) custom-call(%p0, %p1), custom_call_target="__cublas$gemm", metadata={{op_name="{_OP}/feed_forward/hidden/dot_general"}}
  %get-tuple-element.4 = f32[8,6]{{1,0}} get-tuple-element(%custom-call.3), index=0
  %custom-call.7 = (bf16[8,4]{{1,0}}, u8[0]{{0}}) custom-call(%p0, %p0, %p0), custom_call_target="__cudnn$fmhaScaleBiasSoftmax", metadata={{op_name="{_OP}/self_attention/dot_product_attention"}}
  ROOT %loop_multiply_fusion.2 = f32[8,6]{{1,0}} fusion(%get-tuple-element.4), kind=kLoop, calls=%fused_multiply.2, metadata={{op_name="{_OP}/feed_forward_norm/mul"}}
}}
"""


def _gpu_trace() -> list[dict]:
    """Events as the profiler writes a GPU step: a host process, the device's stream and a line it derives."""
    metadata = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 7, "tid": 13, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
        {"ph": "M", "pid": 7, "tid": 2, "name": "thread_name", "args": {"name": "XLA Ops"}},
    ]

    def kernel(name, microseconds, tid=13, **args):
        return {"ph": "X", "pid": 7, "tid": tid, "ts": 0, "dur": microseconds, "name": name, "args": args}

    return [
        *metadata,
        # Each kernel twice (two calls).
        *2 * [kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 400, hlo_op="custom-call.3")],
        *2 * [kernel("cudnn_generated_fort_native_sdpa_sm90_knob_7", 300, hlo_op="custom-call.7")],
        *2 * [kernel("loop_multiply_fusion_2", 200)],  # No hlo_op: found by the kernel's own name.
        *2 * [kernel("Memcpy DtoD (Device -> Device)", 100)],  # No instruction: bucketed by its name.
        # The same kernels again on lines the profiler derives, and host work: not counted.
        kernel("custom-call.3", 400, tid=2, hlo_op="custom-call.3"),
        {"ph": "X", "pid": 1, "tid": 5, "ts": 0, "dur": 5000, "name": "loop_multiply_fusion.2"},
    ]


def test_a_gpu_trace_counts_each_kernel_once_in_the_bucket_of_its_instruction():
    figures = xla_profile.sum_by_bucket(_gpu_trace(), _GPU_HLO, calls=2)
    ms = {label: row["device_ms_per_call"] for label, row in figures["buckets"].items()}
    assert figures["clock"] == "device"
    assert ms["matmuls: projections and feed-forward"] == pytest.approx(0.4)  # cuBLAS, by its hlo_op.
    assert ms["fused attention (cuDNN)"] == pytest.approx(0.3)
    assert ms["layer norms"] == pytest.approx(0.2)  # The fusion's kernel, by its name.
    assert ms["transposes and copies"] == pytest.approx(0.1)  # The copy no instruction claims.
    assert figures["profiled_device_ms_per_call"] == pytest.approx(1.0)
    assert figures["unmatched_share"] == pytest.approx(0.1)
    assert math.fsum(row["share"] for row in figures["buckets"].values()) == pytest.approx(1.0)


def test_a_cpu_trace_sums_the_instructions_of_the_hosts_threads():
    matmul = jax.jit(lambda x: jnp.tanh(x @ x))
    x = jnp.ones((256, 256))
    matmul(x).block_until_ready()
    hlo = matmul.lower(x).compile().as_text()
    figures = xla_profile.profile(lambda: matmul(x).block_until_ready(), hlo, calls=3)
    assert figures["clock"] == "cpu"
    assert figures["profiled_cpu_ms_per_call"] > 0
    assert figures["buckets"]["matmuls: projections and feed-forward"]["cpu_ms_per_call"] > 0
    assert math.fsum(row["share"] for row in figures["buckets"].values()) == pytest.approx(1.0)
    assert figures["unmatched_share"] == 0


def test_kernels_of_no_instruction_are_bucketed_by_name():
    assert xla_profile._kernel_name_bucket("cutlass_80_wmma_tensorop_bf16_s161616gemm") == hlo_buckets.BUCKETS[3][0]
    assert xla_profile._kernel_name_bucket("flash_fwd_kernel") == "fused attention (cuDNN)"
    assert xla_profile._kernel_name_bucket("some_helper") == hlo_buckets.BUCKETS[-1][0]
