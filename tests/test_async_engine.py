"""AsyncEngine: streaming deltas, cancellation and abort free the request, stats, bad input."""

import asyncio

import pytest

from edgeinfer.async_engine import AsyncEngine
from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.errors import EdgeInferError
from edgeinfer.llm import LLM, PromptError

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def path(synthetic_model):
    return str(synthetic_model("llama", "F32"))


@pytest.fixture(scope="module")
def engine(path):
    e = AsyncEngine(path, threads=1)
    yield e
    e.shutdown()


async def collect(stream):
    return [out async for out in stream]


def test_concurrent_streams_deliver_what_generate_returns(engine, path):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 20]

    async def main():
        return await asyncio.gather(*(collect(engine.add_request(p, params)) for p in prompts))

    results = asyncio.run(main())
    expected = LLM(path, threads=1).generate(prompts, params)
    for outs, want in zip(results, expected, strict=True):
        assert "".join(o.text for o in outs) == want.text
        assert [t for o in outs for t in o.token_ids] == want.token_ids
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        last = outs[-1]
        assert last.finish_reason == "length" and last.metrics.generated_tokens == 10
    assert engine.stats().kv_blocks_used == 0 and engine.stats().generated_tokens >= 30


def test_cancelling_the_consumer_aborts_the_request_and_frees_its_blocks(engine):
    async def main():
        stream = engine.add_request([3, 1, 4, 1, 5], LONG, request_id="cancel-me")

        async def consume():
            async for _ in stream:
                pass

        task = asyncio.create_task(consume())
        while engine.stats().generated_tokens == 0 or engine.stats().running == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(500):
            if engine.stats().kv_blocks_used == 0 and engine.stats().running == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())


def test_abort_by_id_ends_the_stream_with_abort(engine):
    async def main():
        stream = engine.add_request([2, 7, 1, 8], LONG, request_id="r1")
        outs = []
        async for out in stream:
            outs.append(out)
            if len(outs) == 2:
                engine.abort("r1")
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finish_reason == "abort" and len(outs) < 200
    assert engine.stats().kv_blocks_used == 0


def test_bad_requests_raise_when_added(engine):
    async def main():
        with pytest.raises(PromptError):
            engine.add_request([], LONG)
        with pytest.raises(PromptError, match="out of range|must be in"):
            engine.add_request([10**9], LONG)
        # long enough to be still running when its id is reused (two tokens could finish first)
        stream = engine.add_request([1, 2], LONG, request_id="dup")
        with pytest.raises(EdgeInferError, match="already in use"):
            engine.add_request([1, 2], SamplingParams(max_tokens=2), request_id="dup")
        engine.abort("dup")
        return await collect(stream)

    assert asyncio.run(main())[-1].finished


def test_a_repeated_prompt_hits_the_prefix_cache(engine):
    prompt = list(range(1, 50))
    params = SamplingParams(temperature=0, max_tokens=2)

    async def main():
        first = await collect(engine.add_request(prompt, params))
        second = await collect(engine.add_request(prompt, params))
        return first, second

    first, second = asyncio.run(main())
    assert first[-1].num_cached_tokens == 0
    assert second[-1].num_cached_tokens == 48 and second[-1].metrics.cached_tokens == 48
    assert [t for o in second for t in o.token_ids] == [t for o in first for t in o.token_ids]
    assert engine.stats().prefix_cache_hit_rate > 0


def test_a_model_that_fails_to_load_raises_in_the_constructor(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(EdgeInferError, match="bad.gguf"):
        AsyncEngine(str(bad))
