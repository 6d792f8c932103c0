"""A garbage frame on the scheduler's sockets is logged and dropped: the instance keeps serving."""

from __future__ import annotations

import time

import pytest
import zmq

from tokenmill import LLM, SamplingParams
from tokenmill.processes import make_socket

SMALL = dict(max_model_len=256, kv_cache_memory_bytes=16 << 20)


@pytest.mark.slow  # a real instance; tests/test_socket_security.py covers the scheduler loop in the fast set
def test_garbage_frames_leave_the_instance_serving(tiny_checkpoints):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM(str(tiny_checkpoints("llama")), **SMALL) as llm:
        before = llm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0].token_ids
        ctx = zmq.Context()
        try:
            for name in ("requests", "results"):  # the frontend's side and the workers' side of the scheduler
                sock = make_socket(ctx, zmq.PUSH, llm.config.ipc_address(name), bind=False)
                for frame in (b"\xc1", b"\x92\xa7Nothing\x01", b"\x00" * 4096):
                    sock.send(frame)
            time.sleep(0.5)  # delivered before the next request
        finally:
            ctx.destroy(linger=1000)
        assert llm.processes.dead_child() is None
        after = llm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert after == before and len(after) == 4
