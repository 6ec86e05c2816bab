"""Sampling parameters validation and the batched sampler."""

from __future__ import annotations

import math

import pytest
import torch
from sovereign_runtime.engine.sampler import Sampler, make_generator
from sovereign_runtime.engine.sampling import SamplingParams

torch.set_num_threads(1)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"stop_token_ids": [1, -3]}, "stop_token_ids"),
        ({"stop_token_ids": "abc"}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_invalid_params_name_the_parameter_and_range(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name) as err:
        SamplingParams(**kwargs)
    assert "must be" in str(err.value)


def test_valid_params_normalise() -> None:
    p = SamplingParams(temperature=0, top_k=-1, stop_token_ids=(3, 4), logprobs=0)
    assert p.greedy and p.top_k == 0 and p.stop_token_ids == [3, 4]


def _logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = _logits()
    out = Sampler()(logits, [SamplingParams(temperature=0)] * 4, [None] * 4)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 4


def test_mixed_batch_greedy_rows_stay_greedy() -> None:
    logits = _logits()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 2
    for _ in range(5):
        out = Sampler()(logits, params, [None] * 4)
        assert out.token_ids[0] == logits[0].argmax().item()
        assert out.token_ids[2] == logits[2].argmax().item()


def test_top_k_one_equals_greedy_and_top_k_restricts_support() -> None:
    logits = _logits(rows=2)
    out = Sampler()(logits, [SamplingParams(temperature=1.5, top_k=1)] * 2, [None] * 2)
    assert out.token_ids == logits.argmax(-1).tolist()
    allowed = set(logits[0].topk(3).indices.tolist())
    seen = {Sampler()(logits[:1], [SamplingParams(top_k=3)], [None]).token_ids[0] for _ in range(200)}
    assert seen <= allowed and len(seen) > 1


def test_top_p_keeps_smallest_set_reaching_mass() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two only.
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    seen = {Sampler()(logits, [SamplingParams(top_p=0.7)], [None]).token_ids[0] for _ in range(300)}
    assert seen == {0, 1}


def test_temperature_sampling_matches_distribution() -> None:
    torch.manual_seed(0)
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(4000, 1)
    out = Sampler()(logits, [SamplingParams(temperature=1.0)] * 4000, [None] * 4000)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)
    # temperature 0.5 squares the odds: p ∝ p^2
    out = Sampler()(logits, [SamplingParams(temperature=0.5)] * 4000, [None] * 4000)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=3).float() / 4000
    sharp = probs**2 / (probs**2).sum()
    assert torch.allclose(freq, sharp, atol=0.03)


def test_seeded_rows_reproduce_whatever_the_batch() -> None:
    logits = _logits(rows=3, vocab=1000)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = [Sampler()(logits[1:2], [p], [make_generator(1234)]).token_ids[0] for _ in range(3)]
    assert len(set(alone)) == 1
    g = make_generator(1234)
    batched = Sampler()(logits, [SamplingParams(), p, SamplingParams()], [None, g, None])
    assert batched.token_ids[1] == alone[0]
    # A sequence of draws from one generator is reproducible too.
    g1, g2 = make_generator(7), make_generator(7)
    seq1 = [Sampler()(logits, [p] * 3, [g1] * 3).token_ids for _ in range(4)]
    seq2 = [Sampler()(logits, [p] * 3, [g2] * 3).token_ids for _ in range(4)]
    assert seq1 == seq2


def test_logprobs_of_chosen_and_top_n() -> None:
    logits = _logits(rows=2)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0)]
    out = Sampler()(logits, params, [None, None])
    ref = torch.log_softmax(logits, -1)
    assert math.isclose(out.logprobs[0], ref[0].max().item(), rel_tol=1e-6)
    assert out.logprobs[1] is None and out.top_logprobs[1] is None
    top = out.top_logprobs[0]
    assert [t for t, _ in top] == ref[0].topk(3).indices.tolist()
    assert all(math.isclose(lp, ref[0, t].item(), rel_tol=1e-6) for t, lp in top)
    assert sum(math.exp(lp) for lp in (lp for _, lp in top)) <= 1.0
