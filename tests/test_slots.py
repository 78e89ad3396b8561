"""Every request's slot in a front end's shared buffer is freed exactly once, whatever ends it
(#22 item 1: a request and its Cancel in the same engine read leaked its slot forever)."""
import shutil
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
from servers import InProcessServer
from test_lifecycle import wait_for

from recserve.client import Client, encode_sparse, random_request
from recserve.v1 import inference_pb2 as pb


def test_1000_requests_cancelled_at_random_moments_leave_the_buffer_empty(tmp_path, artifact):
    shutil.copytree(artifact, tmp_path / "repo" / "demo" / "1")
    server = InProcessServer(tmp_path / "repo", settings={"frontend_buffer_bytes": 16 << 20})
    try:
        with Client(server.target) as client:
            info = client.model_info("demo").models[0]
            dense, sparse = random_request(info, 4, seed=2)
            answer = client.predict("demo", dense, sparse)
            ids = np.zeros(260_000, np.int64)  # about 2 MiB of the buffer each
            big = pb.LookupRequest(model_name="demo", sparse=encode_sparse(
                (["item_id"], np.array([ids.size], np.int32), ids))).SerializeToString()
            call = client.channel.unary_unary("/recserve.v1.Inference/Lookup", request_serializer=None,
                                              response_deserializer=None)
            rng = np.random.default_rng(0)
            deadlines = rng.uniform(0.005, 0.08, 1000)

            def send(i):
                try:
                    call(big, timeout=float(deadlines[i]))
                except grpc.RpcError:
                    pass

            with ThreadPoolExecutor(4) as pool:
                list(pool.map(send, range(1000)))
            cancelled = server.metric("recserve_requests_total", rpc="Lookup", code="DEADLINE_EXCEEDED")
            assert cancelled > 100  # most of them ended before their answer: the path under test
            assert wait_for(lambda: server.metric("recserve_frontend_buffer_used_bytes") == 0, timeout=30)
            assert server.frontend.engine.in_flight == 0
            np.testing.assert_array_equal(client.predict("demo", dense, sparse), answer)
            assert pb.LookupResponse.FromString(call(big, timeout=30)).pooled.shape == [1, 16]  # it fits again
    finally:
        server.stop()



def test_a_cancelled_call_frees_its_slot_once_whether_its_answer_came_before_or_after_the_cancel():
    """EngineLink.run, its client gone (the handler cancelled) at each moment: still waiting, it tells
    the engine (a CANCEL record after its submission) and its slot is freed when the engine answers,
    the engine may be writing its result till then; answered just before the cancel reached it, no
    CANCEL goes and the handler frees the slot itself (nobody else would); answered and read, freed
    when the caller is done with the result."""
    import asyncio

    from test_engine_units import SCHEMA, decode

    from serving import ipc
    from serving.errors import Cancelled
    from serving.frontend.link import Answer, EngineLink

    async def scenario():
        link = EngineLink("unused.sock", 1 << 20, 0, on_state=lambda: None, on_lost=lambda code: None)
        model = ipc.ModelState("m", 0, 2, SCHEMA, False)
        sparse = decode(["a", "c"], [1, 2], [3, 4, 29])
        seen = []

        async def call():
            async with link.run("Lookup", model, sparse, None, False, None) as (version, result):
                seen.append((version, result.shape))

        async def started():
            task = asyncio.get_running_loop().create_task(call())
            while not link.in_flight:
                await asyncio.sleep(0)
            (record,) = link.channel.submissions.take()
            return task, record[3]

        def sent():
            return [(record[0], record[3]) for record in link.channel.submissions.take()]

        outcomes = []
        task, rid = await started()  # cancelled while the engine has it
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        outcomes.append((sent(), link.arena.used_bytes > 0, link.in_flight))
        link._answer(rid, Answer(2, Cancelled("the client went away"), None))  # the engine's answer to the cancel
        outcomes.append(link.arena.used_bytes)
        task, rid = await started()  # answered, then cancelled before the handler ran again
        link._answer(rid, Answer(2, None, None))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        outcomes.append((sent(), link.arena.used_bytes, link.in_flight))
        task, rid = await started()  # answered and read
        link._answer(rid, Answer(2, None, None))
        await task
        outcomes.append((sent(), link.arena.used_bytes, seen))
        link.arena.close()
        link.channel.close()
        return rid, outcomes

    rid, outcomes = asyncio.run(scenario())
    assert rid == 2 and outcomes == [([(ipc.CANCEL, 0)], True, 1), 0, ([], 0, 0), ([], 0, [(2, (1, 6))])]
