"""proto/tinker.py's protobuf codec against the SDK's own: what the SDK writes decodes here to the
same tokens and arrays, and what this writes the SDK reads back to the same values."""

from __future__ import annotations

import re

import numpy as np
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from asyncrl.proto import tinker as wire


def test_a_forward_backward_request_decodes_as_the_sdk_wrote_it():
    sparse = types.TensorData(data=[2.0, 0.5], dtype="float32", shape=[3, 2], sparse_crow_indices=[0, 1, 1, 2],
                              sparse_col_indices=[1, 0])  # fmt: skip
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={
                "target_tokens": [6, 7, 8],
                "weights": [0.0, 1.0, 1.0],
                "advantages": [-1.5, 0.25, 3.0],
            },
        ),
        types.Datum(
            model_input=types.ModelInput(
                chunks=[types.EncodedTextChunk(tokens=[1]), types.EncodedTextChunk(tokens=[2, 3])]
            ),
            loss_fn_inputs={"target_tokens": [[2, 9], [3, 9], [4, 9]], "weights": sparse},
        ),
    ]
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.8, "tag": "x"}
        ),
        model_id="s1:train:0",
        seq_id=42,
    )
    call = wire.decode_forward_backward(forward_backward_request_to_proto(request).SerializeToString())
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("s1:train:0", 42, "ppo", False)
    assert call.loss_fn_config == {"clip_low_threshold": 0.8, "tag": "x"}
    assert [d.tokens for d in call.data] == [[5, 6, 7], [1, 2, 3]]
    first = call.data[0].inputs
    assert first["target_tokens"].dtype == np.int64 and first["target_tokens"].tolist() == [6, 7, 8]
    assert first["advantages"].tolist() == [-1.5, 0.25, 3.0] and first["weights"].dtype == np.float32
    assert call.data[1].inputs["target_tokens"].tolist() == [[2, 9], [3, 9], [4, 9]]
    assert call.data[1].inputs["weights"].tolist() == [[0.0, 2.0], [0.0, 0.0], [0.5, 0.0]]  # CSR made dense


def test_image_chunks_are_refused_naming_them():
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[
                types.Datum(
                    model_input=types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG", format="png")]),
                    loss_fn_inputs={"target_tokens": [1]},
                )
            ],  # fmt: skip
            loss_fn="cross_entropy",
        ),
        model_id="m",
        seq_id=1,
    )
    with pytest.raises(wire.Unsupported, match="image chunks"):
        wire.decode_forward_backward(forward_backward_request_to_proto(request).SerializeToString())


def test_a_truncated_body_is_a_wire_error():
    with pytest.raises(wire.WireError, match="past the end"):
        wire.decode_forward_backward(b"\x0a\x10ab")


def test_the_sdk_reads_a_forward_backward_output_written_here():
    outputs = [
        {
            "logprobs": np.array([-0.5, -1.25], dtype=np.float32),
            "elementwise_loss": np.array([0.5, 1.25], dtype=np.float32),
        },
        {
            "logprobs": np.array([-2.0], dtype=np.float32),
            "elementwise_loss": np.array([2.0], dtype=np.float32),
        },
    ]
    out = deserialize_forward_backward_output(
        wire.encode_forward_backward_output(outputs, {"loss:sum": 3.75})
    )
    assert out.metrics == {"loss:sum": 3.75} and out.loss_fn_output_type == "ArrayRecord"
    assert [o["logprobs"].data for o in out.loss_fn_outputs] == [[-0.5, -1.25], [-2.0]]
    assert out.loss_fn_outputs[1]["elementwise_loss"].tolist() == [2.0]


def test_the_sdk_reads_a_sample_response_written_here():
    sequences = [
        {"tokens": [4, 5], "logprobs": [-0.25, -3.5], "stop_reason": "length"},
        {"tokens": [9], "logprobs": [-1.0], "stop_reason": "stop"},
    ]
    response = deserialize_sample_response(
        wire.encode_sample_response(sequences, [None, -0.5, -2.0], cached_tokens=3)
    )
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in response.sequences] == [
        ([4, 5], [-0.25, -3.5], "length"), ([9], [-1.0], "stop")]  # fmt: skip
    assert response.prompt_logprobs == [None, -0.5, -2.0] and response.prompt_cache_hit_tokens == 3


def field(number: int, payload: bytes | int, wire_type: int | None = None) -> bytes:
    """One protobuf field: a varint for an int, length-delimited bytes, or raw bytes under
    `wire_type` (to write a field of the wrong type)."""
    out = bytearray()
    if isinstance(payload, int):
        wire._put_key(out, number, wire.VARINT)
        wire._put_varint(out, payload)
    elif wire_type is not None:
        wire._put_key(out, number, wire_type)
        out += payload
    else:
        wire._put_bytes(out, number, payload)
    return bytes(out)


def tensor_input(name: bytes, tensor: bytes) -> bytes:
    """A body with one datum whose loss_fn_inputs hold `tensor` (tinker_public.TensorData)."""
    return field(1, b"m") + field(3, field(2, field(1, name) + field(2, tensor)))


SHAPE = field(4, wire._packed([1, 1]))
MALFORMED = {  # a body the SDK never writes -> what the 400 says
    "config double of 4 bytes": (
        field(1, b"m") + field(7, field(1, b"k") + field(2, field(1, b"\0" * 4, wire.FIXED32))),
        "loss_fn_config['k'] has wire type 5",
    ),
    "legacy config value as a varint": (
        field(1, b"m") + field(5, field(1, b"k") + field(2, 3)),
        "wire type 0",
    ),
    "model_input chunk as a varint": (
        field(1, b"m") + field(3, field(1, field(1, 5))),
        "chunk has wire type 0",
    ),
    "loss input entry as a varint": (
        field(1, b"m") + field(3, field(2, field(1, b"w") + field(2, 7))),
        "wire type 0",
    ),
    "negative dimension": (
        tensor_input(b"w", field(1, b"\0" * 8) + field(3, 1) + field(4, wire._packed([-1, -2]))),
        "negative dimension",
    ),
    "float32 data of 3 bytes": (
        tensor_input(b"w", field(1, b"\0" * 3) + field(3, 1)),
        "3 bytes are not whole",
    ),
    "CSR row pointers of 3 bytes": (
        tensor_input(b"w", field(2, field(2, b"abc")) + field(3, 1) + SHAPE),
        "3 bytes are not whole int64",
    ),
    "tokens of 6 bytes": (field(1, b"m") + field(3, field(1, field(1, field(1, b"\0" * 6)))), "6 bytes"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_body_is_a_wire_error_naming_the_field(case):
    """A WireError (a 400 naming the problem), not a struct/Type/ValueError (a 500, which the SDK
    resends ten times)."""
    body, message = MALFORMED[case]
    with pytest.raises(wire.WireError, match=re.escape(message)):
        wire.decode_forward_backward(body)


def sparse_input(name: bytes, columns: int) -> bytes:
    """A loss input of shape [1, columns] as a CSR tensor holding one float: a few bytes."""
    csr = field(1, np.float32(1.0).tobytes()) + field(2, np.array([0, 1], np.int64).tobytes())
    csr += field(3, np.array([0], np.int64).tobytes())
    return field(
        2, field(1, name) + field(2, field(2, csr) + field(3, 1) + field(4, wire._packed([1, columns])))
    )


def test_sparse_tensors_are_made_dense_only_within_the_calls_budget():
    # One CSR tensor of ~40 bytes declaring 2^40 cells: 4 TiB dense, refused before allocation.
    huge = field(1, b"m") + field(3, sparse_input(b"weights", 1 << 40))
    with pytest.raises(wire.WireError, match=r"loss_fn_inputs\['weights'\] of shape \[1, 1099511627776\]"):
        wire.decode_forward_backward(huge)
    # Each under the budget, together over it: the second is refused (the sum is what is held).
    half = wire.MAX_DENSE_CELLS // 2 + 1
    two = field(1, b"m") + field(3, sparse_input(b"a", half)) + field(3, sparse_input(b"b", half))
    with pytest.raises(
        wire.WireError, match=rf"loss_fn_inputs\['b'\] .* {wire.MAX_DENSE_CELLS // 2 - 1} are left"
    ):
        wire.decode_forward_backward(two)
    call = wire.decode_forward_backward(field(1, b"m") + field(3, sparse_input(b"a", half)))
    assert call.data[0].inputs["a"].shape == (1, half) and call.data[0].inputs["a"].sum() == 1.0
