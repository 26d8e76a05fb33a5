"""The sampler draws from the processed distribution exactly, by counter-based noise only."""
import math

import pytest
import torch

from rollout.exec.sampler import counter_uniform, sample
from rollout.sampling_params import SamplingParams


def draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 7) -> torch.Tensor:
    """n draws from one row of logits, at positions 0..n-1 of one seed (rows sampled as a batch)."""
    rows = logits.expand(n, -1)
    out = sample(rows, [params] * n, [seed] * n, list(range(n)), [[]] * n, [[]] * n, [0] * n)
    return out.next_ids


@pytest.mark.parametrize("params,expected", [
    (SamplingParams(temperature=1.0), None),
    (SamplingParams(temperature=0.5), None),
    (SamplingParams(temperature=1.0, top_k=3), [0.5, 0.3, 0.2]),
    (SamplingParams(temperature=1.0, top_p=0.75), [0.5 / 0.8, 0.3 / 0.8]),
])
def test_frequencies_follow_the_processed_distribution(params, expected):
    probs = torch.tensor([0.5, 0.3, 0.2 - 1e-9, 1e-9 * 0.5, 1e-9 * 0.5, 0.0])
    logits = torch.log(probs)
    n = 40_000
    ids = draw(logits, params, n)
    freq = torch.bincount(ids, minlength=6).double() / n
    if expected is None:
        want = torch.softmax(logits.double() / params.temperature, -1)
    else:
        want = torch.zeros(6, dtype=torch.float64)
        want[:len(expected)] = torch.tensor(expected, dtype=torch.float64)
    assert freq[5] == 0                                  # probability 0 is never drawn
    for f, w in zip(freq.tolist(), want.tolist()):
        assert abs(f - w) <= 5 * math.sqrt(max(w, 1e-6) * (1 - w) / n) + 1e-4, (freq, want)


def test_noise_depends_only_on_seed_and_position():
    seeds = torch.tensor([1, 2**40 + 5, 1, 3])
    pos = torch.tensor([9, 9, 10, 9])
    u = counter_uniform(seeds, pos)
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    assert u[0] != u[2] and u[0] != u[1] and u[0] != u[3]
    assert torch.equal(counter_uniform(seeds[[2, 0]], pos[[2, 0]]), u[[2, 0]])
    many = counter_uniform(torch.zeros(100_000, dtype=torch.int64), torch.arange(100_000))
    assert abs(many.mean().item() - 0.5) < 0.005 and len(set(many.tolist())) == 100_000


def test_a_row_samples_the_same_token_in_any_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * 6
    full = sample(logits, params, list(range(6)), [3] * 6, [[]] * 6, [[]] * 6, [0] * 6).next_ids
    for i in range(6):
        one = sample(logits[i:i + 1], params[:1], [i], [3], [[]], [[]], [0]).next_ids
        assert one.item() == full[i].item()


@pytest.mark.parametrize("kw", [dict(top_k=20), dict(top_k=1), dict(top_p=0.9), dict(top_k=50, top_p=0.8, min_p=0.02),
                                dict(temperature=0.6, min_p=0.1), dict(top_k=4000)])
def test_rows_cut_to_a_few_tokens_sample_as_the_whole_masked_row(kw):
    """The candidate path (top-k of the row, no sort of the vocabulary) draws the tokens the
    dense path (the whole row sorted and masked, its float64 CDF) draws, with the same logprobs."""
    from rollout.exec import sampler

    torch.manual_seed(1)
    bsz, vocab = 64, 16_384
    logits = torch.randn(bsz, vocab) * 4
    params = SamplingParams(**kw)
    seeds, positions = list(range(100, 100 + bsz)), [11] * bsz
    got = sample(logits, [params] * bsz, seeds, positions, [[]] * bsz, None, [0] * bsz)
    scaled = logits / params.temperature
    top_k = torch.full((bsz,), params.top_k)
    top_p, min_p = torch.full((bsz,), params.top_p), torch.full((bsz,), params.min_p)
    kept = sampler.candidates(scaled, [params.top_k] * bsz, top_k, top_p, min_p)
    assert (kept is not None) == (kw != dict(top_k=4000))       # 4,000 of 16,384: the sort is used
    dense = torch.log_softmax(sampler._truncate(scaled, top_k, top_p, min_p), -1)
    want = sampler.inverse_cdf(dense, counter_uniform(seeds, positions))
    assert torch.equal(got.next_ids, want)
    assert torch.allclose(got.logprobs, torch.log_softmax(scaled, -1).gather(1, want[:, None]).squeeze(1))
    proc = sample(logits, [SamplingParams(**kw, logprob_mode="processed")] * bsz, seeds, positions, [[]] * bsz,
                  None, [5] * bsz)
    assert torch.equal(proc.next_ids, want)
    assert torch.allclose(proc.logprobs, dense.gather(1, want[:, None]).squeeze(1), atol=1e-6)
    assert torch.allclose(proc.top_logprobs, torch.topk(dense, 5, -1).values, atol=1e-6)


def test_greedy_rows_beside_sampled_ones_are_not_sampled_and_do_not_move_the_others():
    torch.manual_seed(2)
    logits = torch.randn(6, 3000)
    sampled, greedy = SamplingParams(temperature=0.8, top_k=30), SamplingParams(temperature=0.0)
    mixed = [sampled, greedy, sampled, greedy, greedy, sampled]
    out = sample(logits, mixed, list(range(6)), [4] * 6, [[]] * 6, None, [0] * 6).next_ids
    alone = sample(logits[[0, 2, 5]], [sampled] * 3, [0, 2, 5], [4] * 3, [[]] * 3, None, [0] * 3).next_ids
    assert torch.equal(out[[1, 3, 4]], logits[[1, 3, 4]].argmax(-1))
    assert torch.equal(out[[0, 2, 5]], alone)


def test_greedy_rows_beside_cut_rows_keep_their_untruncated_processed_logprobs():
    torch.manual_seed(3)
    logits = torch.randn(4, 8000) * 3
    cut, greedy = (SamplingParams(temperature=1.0, top_k=10, logprob_mode="processed"),
                   SamplingParams(temperature=0.0, logprob_mode="processed"))
    out = sample(logits, [cut, greedy, cut, greedy], list(range(4)), [9] * 4, [[]] * 4, None, [3] * 4)
    want = torch.log_softmax(logits[[1, 3]], -1)
    assert torch.equal(out.next_ids[[1, 3]], logits[[1, 3]].argmax(-1))
    assert torch.allclose(out.top_logprobs[[1, 3]], torch.topk(want, 3, -1).values)
    assert bool(torch.isfinite(out.top_logprobs[[0, 2]]).all())


def test_noise_hashed_by_the_caller_draws_what_sample_hashes_itself():
    """The engine hashes each row's noise before the forward (SamplePlan.noise): the same tokens
    and logprobs as sample hashing it from the seeds and positions, greedy rows beside or not."""
    torch.manual_seed(3)
    logits = torch.randn(6, 3000)
    seeds, positions = [7, 1, 2**62, 3, 4, 5], [9, 4, 1, 0, 33, 2]
    for params in ([SamplingParams(temperature=0.7)] * 6,
                   [SamplingParams(temperature=0.8, top_k=30), SamplingParams(temperature=0.0)] * 3):
        want = sample(logits, params, seeds, positions, [[]] * 6, None, [0] * 6)
        # NOTE: other seeds and positions: the noise given is what is drawn with
        got = sample(logits, params, [0] * 6, [0] * 6, [[]] * 6, None, [0] * 6,
                     noise=counter_uniform(seeds, positions))
        assert torch.equal(got.next_ids, want.next_ids) and torch.equal(got.logprobs, want.logprobs)


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=1.0, top_k=5)])
def test_raw_logprobs_are_the_unprocessed_log_softmax(kw):
    torch.manual_seed(4)
    logits = torch.randn(5, 700) * 3
    params = [SamplingParams(**kw, logprob_mode="raw")] * 5
    out = sample(logits, params, list(range(5)), [2] * 5, [[]] * 5, None, [3] * 5)
    want = torch.log_softmax(logits, -1)
    assert torch.equal(out.logprobs, want.gather(1, out.next_ids[:, None]).squeeze(1))
    assert torch.equal(out.top_logprobs, torch.topk(want, 3, -1).values)
