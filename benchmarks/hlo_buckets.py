"""XLA instructions by what they compute, read from a compiled HLO module: the step and decoding profiles' buckets.

An instruction's bucket is the first of `BUCKETS` that any of its operations passes, each tested
by its opcode and its JAX operation name (`metadata.op_name`): a fusion by every operation it
fuses, so a matmul with a fused cast counts as a matmul and a layer norm with a fused cast as a
layer norm; casts and transposes count alone only where nothing else is fused with them.
A custom call's opcode carries its target ('custom-call:__cudnn$fmhaScaleBiasSoftmax'), so the
library kernels of a GPU module (cuBLAS matmuls, cuDNN's fused attention) are told apart too, and a
dot with batch dimensions is a 'batched-dot'.
"""

import collections
import re


def _is_matmul(opcode: str, op_name: str) -> bool:
    library_matmul = opcode.startswith("custom-call:") and ("gemm" in opcode or "matmul" in opcode)  # cuBLAS(Lt).
    return opcode in ("dot", "batched-dot", "convolution") or library_matmul or op_name.endswith("dot_general")


def _is_fused_attention(opcode: str, _) -> bool:
    """cuDNN's fused attention kernels (forward and backward), whole attentions in one custom call."""
    return opcode.startswith("custom-call:") and "fmha" in opcode


def _is_attention_product(opcode: str, op_name: str) -> bool:
    """QK^T and the weighted values: products of the attention's own `attend`, not of its projections.

    A dot with batch dimensions is one too where XLA dropped its op_name (XLA:CPU's products of a decoding
    step's query with its cache): the attention's are the model's only matmuls batched over rows and heads.
    """
    own = re.search(r"_attention\.attend/dot_general$", op_name) is not None
    return _is_matmul(opcode, op_name) and (own or (opcode == "batched-dot" and not op_name))


def _outside_model(_, op_name: str) -> bool:
    """Work of no Transformer module (a train step's optimizer, a decoding loop's search).

    An operation without an op_name (one XLA made, such as a layout copy inside a fusion) is
    nobody's: the fusion's other operations say what it is.
    """
    return bool(op_name) and "Transformer" not in op_name


# (bucket, test on one operation: its opcode and JAX op_name). An instruction goes to the first
# bucket any of its operations (a fusion's: every fused one) passes.
BUCKETS = (
    ("fused attention (cuDNN)", _is_fused_attention),
    ("matmuls: vocabulary projection", lambda opcode, op_name: _is_matmul(opcode, op_name) and "_logits" in op_name),
    ("matmuls: attention products", _is_attention_product),
    ("matmuls: projections and feed-forward", _is_matmul),
    ("loss (softmax cross-entropy, its gradient)", lambda _, op_name: "jvp()" in op_name or "_logits" in op_name),
    ("dropout (random bits, masks)", lambda _, op_name: "dropout" in op_name),
    ("layer norms", lambda _, op_name: "_norm/" in op_name or "LayerNorm" in op_name),
    ("attention softmax and masks", lambda _, op_name: "attention" in op_name),
    ("embeddings and positions", lambda _, op_name: "embed" in op_name),
    ("optimizer (Adam, gradient norm, finite checks)", _outside_model),
    ("casts", lambda opcode, op_name: opcode == "convert" or op_name.endswith("convert_element_type")),
    ("transposes and copies", lambda opcode, op_name: opcode in ("transpose", "copy") or op_name.endswith("transpose")),
    ("other model work (residuals, activations)", lambda _, __: True),
)


def _is_beam_gather(opcode: str, op_name: str) -> bool:
    return _outside_model(opcode, op_name) and (opcode == "gather" or "take_along_axis" in op_name)


def _is_cache_write(opcode: str, op_name: str) -> bool:
    return opcode == "dynamic-update-slice" or op_name.endswith("dynamic_update_slice")


_BY_LABEL = dict(BUCKETS)
# The same for a decoding loop (benchmarks/decode_speed.py), where the search takes the optimizer's place.
_MATMULS = BUCKETS[:4]  # Fused attention and the matmuls.
DECODE_BUCKETS = (
    *_MATMULS,
    ("search: reordering beams (cache gathers)", _is_beam_gather),
    ("search: log-softmax, top-k, bookkeeping", _outside_model),
    ("cache writes", _is_cache_write),
    *(
        (label, _BY_LABEL[label])
        for label in ("layer norms", "attention softmax and masks", "embeddings and positions")
    ),
    *BUCKETS[-3:],  # Casts, transposes and copies, the rest.
)
# Operations that compute nothing themselves: left out of a fusion's tests.
_INERT = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}
CONTAINERS = {"while", "call", "conditional", "async-start", "async-done"}  # Their inner instructions have events.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (?:\([^=]*?\)|\S+) ([a-z][\w\-]*)\((.*)$")
# XLA numbers a long tuple's elements in its shape (`(s32[], ..., /*index=5*/u32[])`): not an instruction's `=`.
_TUPLE_INDEX = re.compile(r"/\*index=\d+\*/")
_CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+) \(.*\{$")


def operations(hlo: str) -> tuple[dict, dict]:
    """(instruction -> (opcode, op_name, called computations), computation -> its instructions' names)."""
    instructions, computations, current = {}, collections.defaultdict(list), None
    for line in hlo.splitlines():
        line = _TUPLE_INDEX.sub("", line)
        if match := _COMPUTATION.match(line):
            current = match.group(1)
        elif match := _INSTRUCTION.match(line):
            name, opcode, rest = match.groups()
            op_name = re.search(r'op_name="([^"]*)"', rest)
            calls = re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", rest)
            if opcode == "custom-call" and (target := _CUSTOM_CALL_TARGET.search(rest)):
                opcode = f"custom-call:{target.group(1)}"
            elif opcode == "dot" and "lhs_batch_dims=" in rest:
                opcode = "batched-dot"
            instructions[name] = (opcode, op_name.group(1) if op_name else "", calls)
            computations[current].append(name)
    return instructions, computations


def _fused_operations(name: str, instructions: dict, computations: dict) -> list[tuple[str, str]]:
    """(opcode, op_name) of an instruction and of everything its called computations hold."""
    opcode, op_name, calls = instructions[name]
    found = [(opcode, op_name)]
    for computation in calls:
        for inner in computations.get(computation, ()):
            found += _fused_operations(inner, instructions, computations)
    return found


def bucket(name: str, instructions: dict, computations: dict, buckets=BUCKETS) -> str:
    """The first of `buckets` that any operation of instruction `name` falls in."""
    computing = [
        (opcode, op_name)
        for opcode, op_name in _fused_operations(name, instructions, computations)
        if opcode not in _INERT and opcode != "fusion"
    ]
    return next(
        (label for label, test in buckets if any(test(opcode, op_name) for opcode, op_name in computing)),
        buckets[-1][0],  # Nothing but inert operations.
    )
