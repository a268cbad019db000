"""benchmarks/xla_profile.py sums a trace's kernel times by bucket: a CPU trace's threads, a GPU trace's kernels."""

# ruff: noqa: E501  (the module below is written as XLA prints it: one instruction a line)

import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import REPO_ROOT, entry_point_env
from jax.profiler import ProfileData

from benchmarks import hlo_buckets, xla_profile, xplane_kernels

_OP = "jit(train_step)/transpose(jvp(Transformer))/Transformer.decode/decoder/layers_0"
# A compiled GPU module as XLA:GPU prints it: a cuBLAS matmul, cuDNN's fused attention, a fusion.
_GPU_HLO = f"""HloModule jit_train_step, is_scheduled=true

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
_STATS = ("hlo_op", "hlo_module", "program_id")


def _event(name_id: int, start_us: float, duration_us: float, hlo_op: str = "", program_id: int = 12) -> str:
    stats = f'stats {{ metadata_id: 1 str_value: "{hlo_op}" }} ' if hlo_op else ""
    stats += (
        f'stats {{ metadata_id: 2 str_value: "jit_train_step" }} stats {{ metadata_id: 3 int64_value: {program_id} }}'
    )
    return f"events {{ metadata_id: {name_id} offset_ps: {int(start_us * 1e6)} duration_ps: {int(duration_us * 1e6)} {stats} }}"


def _gpu_profile() -> ProfileData:
    """A raw profile as XLA:GPU writes two calls of a step: the device's stream, a line derived from it, the host."""
    names = (
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n",
        "cudnn_generated_fort_native_sdpa_sm90",
        "loop_multiply_fusion_2",
        "Memcpy DtoD (Device -> Device)",
    )
    stream = []
    for call in range(
        2
    ):  # Each call: gemm 400 us, 100 us idle, attention 300 us, fusion 200 us, copy 100 us; 100 us idle.
        start = call * 1200
        stream += [
            _event(1, start, 400, "custom-call.3"),
            _event(2, start + 500, 300, "custom-call.7"),
            _event(3, start + 800, 200),  # No hlo_op: joined by the kernel's own name.
            _event(4, start + 1000, 100, "copy-start.99"),  # No instruction of the module: unattributed.
        ]
    metadata = " ".join(
        f'event_metadata {{ key: {i} value {{ id: {i} name: "{name}" }} }}' for i, name in enumerate(names, 1)
    )
    metadata += " " + " ".join(
        f'stat_metadata {{ key: {i} value {{ id: {i} name: "{name}" }} }}' for i, name in enumerate(_STATS, 1)
    )
    device = f"""planes {{ id: 2 name: "/device:GPU:0"
      lines {{ id: 13 name: "Stream #13(Compute)" timestamp_ns: 1000 {" ".join(stream)} }}
      lines {{ id: 2 name: "XLA Ops" timestamp_ns: 1000 {_event(1, 0, 400, "custom-call.3")} }}
      {metadata} }}"""
    host = f"""planes {{ id: 1 name: "/host:CPU"
      lines {{ id: 5 name: "python" timestamp_ns: 0 {_event(3, 0, 5000, "loop_multiply_fusion.2")} }}
      {metadata} }}"""
    return ProfileData.from_text_proto(host + device)


def test_a_gpu_profile_counts_each_kernel_of_the_devices_streams_once_and_its_idle_gaps():
    kernels, clock = xplane_kernels.kernels(_gpu_profile())
    assert clock == "device" and len(kernels) == 8  # The stream's; not the derived line's, not the host's.
    figures = xla_profile.sum_by_bucket(kernels, clock, {12: _GPU_HLO}, calls=2)
    ms = {label: row["device_ms_per_call"] for label, row in figures["buckets"].items()}
    assert ms["matmuls: projections and feed-forward"] == pytest.approx(0.4)  # cuBLAS, by its hlo_op.
    assert ms["fused attention (cuDNN)"] == pytest.approx(0.3)
    assert ms["layer norms"] == pytest.approx(0.2)  # The fusion's kernel, by its name.
    assert ms["transposes and copies"] == pytest.approx(0.1)  # The copy no instruction claims, by its name.
    # 100 us inside each call, and 100 us between the calls: 300 us over two calls.
    assert ms[xla_profile.IDLE] == pytest.approx(0.15)
    assert figures["profiled_device_ms_per_call"] == pytest.approx(1.15)
    assert figures["unmatched_share"] == pytest.approx(0.1)  # Of kernel time: idle gaps are not kernels.
    assert figures["largest_unmatched_kernels"][0]["hlo_op"] == "copy-start.99"
    assert math.fsum(row["share"] for row in figures["buckets"].values()) == pytest.approx(1.0)


def test_kernels_are_joined_to_their_own_programs_module():
    kernels, clock = xplane_kernels.kernels(_gpu_profile())
    # Another program's module (a different id) holds none of these instructions: all unattributed.
    figures = xla_profile.sum_by_bucket(kernels, clock, {13: _GPU_HLO}, calls=2)
    assert figures["unmatched_share"] == pytest.approx(1.0)
    # Joined by the module's name where no dumped module has the kernels' program id.
    figures = xla_profile.sum_by_bucket(kernels, clock, {"jit_train_step": _GPU_HLO}, calls=2)
    assert figures["unmatched_share"] == pytest.approx(0.1)


def test_a_cpu_trace_sums_the_instructions_of_the_hosts_threads():
    matmul = jax.jit(lambda x: jnp.tanh(x @ x))
    x = jnp.ones((256, 256))
    matmul(x).block_until_ready()
    hlo = matmul.lower(x).compile().as_text()
    figures = xla_profile.profile(lambda: matmul(x), hlo, calls=3)
    assert figures["clock"] == "cpu"
    assert figures["profiled_cpu_ms_per_call"] > 0
    assert figures["buckets"]["matmuls: projections and feed-forward"]["cpu_ms_per_call"] > 0
    assert xla_profile.IDLE not in figures["buckets"]  # Threads are not one timeline.
    assert math.fsum(row["share"] for row in figures["buckets"].values()) == pytest.approx(1.0)
    assert figures["unmatched_share"] == 0


# A process whose XLA dumps every module it compiles (XLA_FLAGS is read once, when the backend starts), then
# profiles a matmul and a layer norm, reading its kernels back from the trace's .xplane.pb and the dump.
_DUMPED_RUN = """
import json, sys
import jax, jax.numpy as jnp
from benchmarks import xla_profile

def step(w, x):
    y = jnp.dot(x, w)
    with jax.named_scope("encoder_norm"):
        mean = y.mean(-1, keepdims=True)
        y = (y - mean) * jax.lax.rsqrt(((y - mean) ** 2).mean(-1, keepdims=True) + 1e-6)
    return jnp.tanh(y)

step = jax.jit(step)
w, x = jnp.ones((384, 384)), jnp.ones((256, 384))
step(w, x).block_until_ready()
json.dump(xla_profile.profile(lambda: step(w, x), calls=3, dump_dir=sys.argv[1]), sys.stdout)
"""


def test_a_cpu_trace_is_attributed_through_the_processes_xla_dump(tmp_path):
    env = dict(entry_point_env(), XLA_FLAGS=f"--xla_dump_to={tmp_path}")
    done = subprocess.run(
        [sys.executable, "-c", _DUMPED_RUN, str(tmp_path)], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout)
    ms = {label: row["cpu_ms_per_call"] for label, row in figures["buckets"].items()}
    assert figures["unmatched_share"] < 0.05
    assert ms["matmuls: projections and feed-forward"] > 0
    assert ms["layer norms"] > 0  # A fusion named by what it holds, from the dump.
    matmul = next(row for row in figures["largest_instructions"] if row["op_name"].endswith("dot_general"))
    assert matmul["bucket"] == "matmuls: projections and feed-forward" and matmul["cpu_ms_per_call"] > 0
    assert math.fsum(ms.values()) == pytest.approx(figures["profiled_cpu_ms_per_call"])
    assert math.fsum(row["share"] for row in figures["buckets"].values()) == pytest.approx(1.0)


def test_idle_time_is_the_timeline_with_no_kernel_on_any_line():
    def kernel(line, start, duration):
        return xplane_kernels.Kernel("k", "", "", None, line, start, duration)

    # Stream 1 busy 0-10 and 30-40, stream 2 busy 5-20: idle 20-30 only.
    assert xplane_kernels.idle_ns([kernel("1", 30, 10), kernel("1", 0, 10), kernel("2", 5, 15)]) == 10
    assert xplane_kernels.idle_ns([]) == 0


def test_kernels_of_no_instruction_are_bucketed_by_name():
    assert xla_profile._kernel_name_bucket("cutlass_80_wmma_tensorop_bf16_s161616gemm") == hlo_buckets.BUCKETS[3][0]
    assert xla_profile._kernel_name_bucket("flash_fwd_kernel") == "fused attention (cuDNN)"
    assert xla_profile._kernel_name_bucket("some_helper") == hlo_buckets.BUCKETS[-1][0]


def test_a_dump_gives_each_module_by_program_id_and_the_largest_of_each_name(tmp_path):
    for file_name, text in (
        ("module_0006.jit_step.cpu_after_optimizations.txt", "HloModule jit_step\nsmall"),
        ("module_0008.jit_step.sm_9.0_gpu_after_optimizations.txt", "HloModule jit_step\nthe larger one"),
        ("module_0008.jit_step.cpu_after_optimizations-buffer-assignment.txt", "not a module"),
    ):
        (tmp_path / file_name).write_text(text)
    modules = xplane_kernels.dumped_modules(str(tmp_path))
    assert modules == {
        6: "HloModule jit_step\nsmall",
        8: "HloModule jit_step\nthe larger one",
        "jit_step": modules[8],
    }
