import asyncio
import logging

import numpy as np
import zmq
import zmq.asyncio

from areal_flow.runtime.ports import free_ports
from areal_flow.transport.channels import endpoint, make_socket, recv, send
from areal_flow.transport.messages import Array, ScoredGroup, Sample, decode, encode


def make_sample() -> Sample:
    return Sample(uid="g1-0", prompt_id="p1", group_id=1, index=0, birth_time=2.5, fields={"prompt": "1+2="},
                  arrays={"output_ids": Array.of(np.array([3, 4, 5], dtype=np.int32)),
                          "behav_logprobs": Array.of(np.array([-0.5, -1.25, 0.0], dtype=np.float32))},
                  scalars={"rewards": 1.0})


def test_arrays_travel_as_raw_little_endian_bytes():
    wire = encode(ScoredGroup(1, [make_sample()]))
    # The 3 int32 token ids appear verbatim in the frame: no per-element encoding, no pickle.
    assert np.array([3, 4, 5], dtype="<i4").tobytes() in wire
    assert b"\x80\x04" not in wire[:2]  # not a pickle stream
    back = decode(wire)
    assert back.samples[0].array("output_ids").tolist() == [3, 4, 5]
    assert back.samples[0].array("behav_logprobs").dtype == np.float32
    big_endian = Array.of(np.array([1, 2], dtype=">i4"))
    assert big_endian.numpy().tolist() == [1, 2] and big_endian.dtype == "<i4"


def test_a_message_that_does_not_decode_is_logged_and_the_receiver_keeps_working(caplog):
    port = free_ports(1)[0]

    async def main():
        ctx = zmq.asyncio.Context()
        pull = make_socket(ctx, zmq.PULL, bind=endpoint(port))
        push = make_socket(ctx, zmq.PUSH, connect=endpoint(port))
        await push.send(b"\xc1not msgpack")
        await push.send(encode(make_sample()))  # valid msgpack, but not a tagged Message
        await send(push, ScoredGroup(7, [make_sample()]))
        got = await asyncio.wait_for(recv(pull, "test inbox"), 5)
        push.close(), pull.close(), ctx.term()
        return got

    with caplog.at_level(logging.ERROR, logger="areal_flow.transport"):
        got = asyncio.run(main())
    assert isinstance(got, ScoredGroup) and got.group_id == 7
    rejected = [r for r in caplog.records if "does not decode" in r.getMessage()]
    assert len(rejected) == 2 and "test inbox" in rejected[0].getMessage()


def test_arrays_that_do_not_fit_their_dtype_are_rejected_on_decode():
    import msgspec
    import pytest

    from areal_flow.transport.messages import decode

    def wire(dtype: str, data: bytes) -> bytes:
        sample = {"uid": "g1-0", "prompt_id": "p", "group_id": 1, "index": 0, "birth_time": 0.0,
                  "arrays": {"output_ids": [dtype, data]}}
        return msgspec.msgpack.encode({"type": "ScoredGroup", "group_id": 1, "samples": [sample]})

    assert decode(wire("<i4", b"\x01\x00\x00\x00")).samples[0].array("output_ids").tolist() == [1]
    with pytest.raises(msgspec.ValidationError, match="whole number"):
        decode(wire("<i4", b"\x01\x00\x00"))
    with pytest.raises(msgspec.ValidationError, match="dtype 'object'"):
        decode(wire("object", b""))
