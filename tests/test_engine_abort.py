"""Abort at every stage (waiting, prefilling, decoding) frees every slot and returns partial output."""
import random

from rollout.config import DEFAULT_MODEL_PATH, EngineConfig
from rollout.core.engine_core import EngineCore
from rollout.core.request import Req
from rollout.sampling_params import SamplingParams
from core_driver import CoreDriver


def make_core(path, **kw) -> EngineCore:
    return EngineCore(EngineConfig(model_path=str(path), tokenizer_path=DEFAULT_MODEL_PATH, dtype="float32", **kw))


def make_req(rid, n, seed=0, max_new=16, **kw) -> Req:
    rng = random.Random(seed)
    return Req(uid=seed, rid=rid, prompt_ids=[rng.randrange(3, 256) for _ in range(n)],
               params=SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True),
               seed=1, return_logprob=True, max_total_len=512, **kw)


def test_abort_at_each_stage(tiny_checkpoint):
    core = make_core(tiny_checkpoint("qwen3_moe"), chunked_prefill_size=8, max_running_requests=2)
    driver = CoreDriver(core)
    waiting = make_req("waiting", 10, 1)
    prefilling = make_req("prefilling", 30, 2)
    decoding = make_req("decoding", 5, 3)
    driver.add(decoding)
    driver.step()                    # decoding: prefilled, first token sampled
    driver.step()                    # one decode step
    driver.add(prefilling)
    driver.add(waiting)              # max_running_requests=2: stays waiting
    driver.step()                    # first 8-token chunk of `prefilling`
    assert prefilling.kv_len == 8 and waiting.kv_len == 0 and len(decoding.output_ids) == 2
    for req, n_out in ((waiting, 0), (prefilling, 0), (decoding, 2)):
        assert core.abort(req.uid)
        driver.absorb()
        core.check_integrity()
        out = driver.outputs[req.rid]
        assert out.finish_reason == "abort" and len(out.output_ids) == n_out
        assert len(out.output_logprobs) == n_out
    assert not core.abort(decoding.uid)
    assert not core.has_work()
    core.check_integrity()
    assert core.flush_cache()
    assert core.kv_pool.used() == 0
