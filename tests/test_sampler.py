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
