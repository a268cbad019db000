"""benchmarks/hlo_buckets.py puts each XLA instruction in the bucket of what it computes."""

# ruff: noqa: E501  (the module below is written as XLA prints it: one instruction a line)

from benchmarks import hlo_buckets

_OP = "jit(train_step)/transpose(jvp(Transformer))/Transformer.decode/decoder/layers_0/layers_0._sublayers"
# A compiled module's lines as XLA:CPU prints them: fusions, their computations and metadata.
_HLO = f"""
%fused_computation.1 (param_0.1: bf16[8,4], param_1.1: bf16[4,6]) -> f32[8,6] {{
  %param_0.1 = bf16[8,4]{{1,0}} parameter(0)
  %param_1.1 = bf16[4,6]{{1,0}} parameter(1)
  ROOT %dot.1 = f32[8,6]{{1,0}} dot(%param_0.1, %param_1.1), metadata={{op_name="{_OP}/feed_forward/hidden/dot_general"}}
}}

%fused_computation.2 (param_0.2: f32[8,6]) -> bf16[8,6] {{
  %param_0.2 = f32[8,6]{{1,0}} parameter(0)
  %multiply.2 = f32[8,6]{{1,0}} multiply(%param_0.2, %param_0.2), metadata={{op_name="{_OP}/feed_forward_norm/mul"}}
  ROOT %convert.2 = bf16[8,6]{{1,0}} convert(%multiply.2), metadata={{op_name="{_OP}/convert_element_type"}}
}}

%fused_computation.3 (param_0.3: f32[8,6]) -> bf16[8,6] {{
  %param_0.3 = f32[8,6]{{1,0}} parameter(0)
  ROOT %convert.3 = bf16[8,6]{{1,0}} convert(%param_0.3), metadata={{op_name="{_OP}/convert_element_type"}}
}}

%fused_computation.6 (param_0.6: bf16[8,6]) -> f32[6,8] {{
  %param_0.6 = bf16[8,6]{{1,0}} parameter(0)
  %transpose.6 = bf16[6,8]{{0,1}} transpose(%param_0.6)
  %copy.6 = bf16[6,8]{{1,0}} copy(%transpose.6)
  ROOT %convert.6 = f32[6,8]{{1,0}} convert(%copy.6)
}}

ENTRY %main.4 (p0: bf16[8,4], p1: bf16[4,6], p2: f32[6]) -> (f32[8,6], bf16[8,6], bf16[8,6], f32[6]) {{
  %p0 = bf16[8,4]{{1,0}} parameter(0)
  %p1 = bf16[4,6]{{1,0}} parameter(1)
  %p2 = f32[6]{{0}} parameter(2)
  %ynn_fusion.1 = f32[8,6]{{1,0}} fusion(%p0, %p1), kind=kCustom, calls=%fused_computation.1, metadata={{op_name="{_OP}/feed_forward/hidden/dot_general"}}
  %norm_fusion.2 = bf16[8,6]{{1,0}} fusion(%ynn_fusion.1), kind=kLoop, calls=%fused_computation.2, metadata={{op_name="{_OP}/convert_element_type"}}
  %convert_fusion.3 = bf16[8,6]{{1,0}} fusion(%ynn_fusion.1), kind=kLoop, calls=%fused_computation.3, metadata={{op_name="{_OP}/convert_element_type"}}
  %sqrt.4 = f32[6]{{0}} sqrt(%p2), metadata={{op_name="jit(train_step)/sqrt"}}
  %layout_fusion.6 = f32[6,8]{{1,0}} fusion(%norm_fusion.2), kind=kLoop, calls=%fused_computation.6, metadata={{op_name="{_OP}/self_attention.attend/reshape"}}
  ROOT %tuple.5 = (f32[8,6]{{1,0}}, bf16[8,6]{{1,0}}, bf16[8,6]{{1,0}}, f32[6]{{0}}) tuple(%ynn_fusion.1, %norm_fusion.2, %convert_fusion.3, %sqrt.4)
}}
"""


def test_each_instruction_goes_to_the_bucket_of_what_it_computes():
    instructions, computations = hlo_buckets.operations(_HLO)
    buckets = {name: hlo_buckets.bucket(name, instructions, computations) for name in instructions}
    assert buckets["ynn_fusion.1"] == "matmuls: projections and feed-forward"
    assert buckets["norm_fusion.2"] == "layer norms"  # The fused cast does not make it a cast.
    assert buckets["convert_fusion.3"] == "casts"  # A cast alone is one.
    assert buckets["sqrt.4"] == "optimizer (Adam, gradient norm, finite checks)"  # Outside the model.
    assert buckets["tuple.5"] == hlo_buckets.BUCKETS[-1][0]  # Only inert operations: not an error.
    # XLA's own operations (no op_name) are nobody's: a layout copy and cast, not the optimizer's.
    assert buckets["layout_fusion.6"] == "casts"


def test_decoding_buckets_tell_the_search_from_the_model():
    instructions, computations = hlo_buckets.operations(_HLO)
    decode_buckets = {
        name: hlo_buckets.bucket(name, instructions, computations, hlo_buckets.DECODE_BUCKETS) for name in instructions
    }
    assert decode_buckets["sqrt.4"] == "search: log-softmax, top-k, bookkeeping"  # Outside the model.
    assert decode_buckets["layout_fusion.6"] == "casts"
    assert decode_buckets["ynn_fusion.1"] == "matmuls: projections and feed-forward"
    beam_gather = next(test for label, test in hlo_buckets.DECODE_BUCKETS if label.startswith("search: reordering"))
    assert beam_gather("gather", "jit(beam_search)/while/body/take_along_axis")
    assert not beam_gather("gather", "jit(beam_search)/while/body/Transformer.decode_step/embed/take")


def test_the_vocabulary_projection_and_attention_products_are_told_apart_from_other_matmuls():
    def matmul_bucket(op_name: str) -> str:
        return next(label for label, test in hlo_buckets.BUCKETS if test("dot", op_name))

    assert matmul_bucket("x/Transformer._logits/shared_embedding.attend/dot_general").endswith("vocabulary projection")
    assert matmul_bucket("x/self_attention/self_attention.attend/dot_general").endswith("attention products")
    assert matmul_bucket("x/self_attention/self_attention.attend/query/dot_general").endswith("feed-forward")


def test_a_batched_dot_without_op_name_is_an_attention_product():
    # XLA:CPU drops the op_name of a decoding step's products of its query with the cache.
    lines = (
        "  %dot.141 = f32[256,128,1]{2,1,0} dot(%bitcast.12, %bitcast.11), lhs_batch_dims={0}, "
        "lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}\n"
        "  %dot.7 = f32[64,256]{1,0} dot(%p.1, %p.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}"
    )
    instructions, computations = hlo_buckets.operations(lines)
    assert hlo_buckets.bucket("dot.141", instructions, computations).endswith("attention products")
    assert hlo_buckets.bucket("dot.7", instructions, computations).endswith("projections and feed-forward")


def test_an_instruction_whose_tuple_shape_numbers_its_elements_is_read():
    # XLA writes /*index=5*/ into tuples of six or more elements (a dropout's bit loop, a multi-output fusion).
    line = (
        "  %while.309 = (s32[], u32[4]{0}, u32[4]{0}, u32[], u32[], /*index=5*/u32[], u32[4]{0}) while(%tuple.231), "
        'condition=%cond.1, body=%body.1, metadata={op_name="jit(train_step)/dropout/jit(_uniform)/while"}'
    )
    instructions, _ = hlo_buckets.operations(line)
    assert instructions["while.309"] == ("while", "jit(train_step)/dropout/jit(_uniform)/while", ["cond.1", "body.1"])
