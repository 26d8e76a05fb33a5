"""GenerateArgs (the one typed request of generate / async_generate / submit) and PendingCalls (the
engine clients' one table of command replies)."""
import asyncio
import threading

import pytest

from rollout import Rollout
from rollout.frontend.engine_client import EngineDeadError, PendingCalls
from rollout.generate_io import PER_PROMPT, GenerateArgs
from rollout.ipc.messages import Reply

GREEDY = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}


def test_per_prompt_broadcasts_and_names_a_wrong_count():
    args = GenerateArgs(input_ids=[[1], [2], [3]], return_logprob=True, rid=["a", "b", "c"], cache_salt="s")
    assert args.per_prompt("return_logprob", 3) == [True, True, True]
    assert args.per_prompt("rid", 3) == ["a", "b", "c"]
    assert args.per_prompt("cache_salt", 3) == ["s", "s", "s"]   # a string is one value, not a list
    with pytest.raises(ValueError, match=r"^rid has 3 entries for 2 prompts$"):
        args.per_prompt("rid", 2)
    assert set(PER_PROMPT) < {f for f in GenerateArgs.__dataclass_fields__}


def test_of_takes_keywords_or_a_whole_request():
    whole = GenerateArgs(input_ids=[1, 2], stream=True)
    assert GenerateArgs.of(whole, None, {}) is whole
    assert GenerateArgs.of("hi", {"n": 2}, {"rid": "r"}) == GenerateArgs(prompts="hi", sampling_params={"n": 2},
                                                                      rid="r")
    with pytest.raises(ValueError, match="pass it alone"):
        GenerateArgs.of(whole, None, {"rid": "r"})
    with pytest.raises(TypeError, match="return_logprobs"):
        GenerateArgs.of("hi", None, {"return_logprobs": True})   # a misspelt field is refused


@pytest.fixture(scope="module")
def engine():
    with Rollout(dtype="float32", client="inproc", enable_return_routed_experts=True) as e:
        yield e


def test_every_entry_point_takes_the_same_request(engine):
    args = GenerateArgs(input_ids=[[5, 6, 7], [8, 9]], sampling_params=GREEDY, return_logprob=[True, False],
                        return_routed_experts=True)
    by_keywords = engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=GREEDY,
                                  return_logprob=[True, False], return_routed_experts=True)
    whole = engine.generate(args)
    got: list = []
    done = threading.Event()

    def sink(item):
        got.append(item)
        if len(got) == 2:
            done.set()

    rids = engine.submit(sink, args).rids
    assert done.wait(60)
    submitted = sorted(got, key=lambda o: rids.index(o.rid))
    asynced = asyncio.run(_await(engine.async_generate(args)))
    for outs in (whole, submitted, asynced):
        assert [o.output_ids for o in outs] == [o.output_ids for o in by_keywords]
        assert [o.output_logprobs for o in outs] == [o.output_logprobs for o in by_keywords]
        assert all(a.routed_experts.equal(b.routed_experts) for a, b in zip(outs, by_keywords))
    assert by_keywords[0].output_logprobs is not None and by_keywords[1].output_logprobs is None


async def _await(gen):
    return await gen


def test_values_are_checked_once_in_the_front_end(engine):
    with pytest.raises(ValueError, match=r"^logprob_start_len must be -1 or an integer >= 0, got -2$"):
        engine.generate(GenerateArgs(input_ids=[1, 2], logprob_start_len=-2))
    with pytest.raises(ValueError, match=r"^top_logprobs_num has 1 entries for 2 prompts$"):
        engine.generate(input_ids=[[1, 2], [3]], top_logprobs_num=[1])
    assert engine.num_in_flight == 0


def test_pending_calls_resolve_per_rank_and_fail_on_death():
    calls = PendingCalls(2)
    call_id, futures = calls.open()
    calls.resolve(Reply(call_id=call_id, result=7), rank=1)
    calls.resolve(Reply(call_id=call_id, error="bad tags", error_type="ValueError"), rank=0)
    assert futures[1].result() == 7
    with pytest.raises(ValueError, match="bad tags"):
        futures[0].result()
    calls.close(call_id)
    calls.resolve(Reply(call_id=call_id, result=1))   # a late reply to a closed call is dropped

    call_id, futures = calls.open()
    calls.fail_all("engine process exited with code 9")
    with pytest.raises(EngineDeadError, match="exited with code 9"):
        PendingCalls.wait(futures, lambda: None)
