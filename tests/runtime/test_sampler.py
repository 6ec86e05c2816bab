"""Sampling parameters validation and the batched sampler."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from sovereign_runtime.engine.sampler import Sampler, apply_penalties, make_generator
from sovereign_runtime.engine.sampling import SamplingDefaults, SamplingParams, read_generation_config

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
        ({"top_k": 2**63}, "top_k"),  # overflowed int64 inside the engine step (the adversarial suite)
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
        ({"logit_bias": [[1, 2]]}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
        ({"logit_bias": {"3": "1"}}, "logit_bias"),
        ({"logit_bias": {"3": math.inf}}, "logit_bias"),
        ({"logit_bias": {"3": 100.5}}, "logit_bias"),
        ({"logit_bias": {str(t): 1 for t in range(301)}}, "logit_bias"),
        ({"logit_bias": {"3": 1, 3: 2}}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"presence_penalty": "high"}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
    ],
)
def test_invalid_params_name_the_parameter_and_range(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name) as err:
        SamplingParams(**kwargs)
    assert "must be" in str(err.value)


def test_valid_params_normalise() -> None:
    p = SamplingParams(temperature=0, top_k=-1, stop_token_ids=(3, 4), logprobs=0)
    assert p.greedy and p.top_k == 0 and p.stop_token_ids == [3, 4]


def test_logit_bias_keys_normalise_and_survive_a_json_round_trip() -> None:
    p = SamplingParams(logit_bias={"15": -100, 7: 2.5})
    assert p.logit_bias == {15: -100.0, 7: 2.5}
    # The PD path ships parameters as JSON (integer keys come back as strings) and samples the first token
    # with for_first_token(): the bias must survive both.
    again = SamplingParams(**json.loads(json.dumps(dataclasses.asdict(p)))).for_first_token()
    assert again.logit_bias == p.logit_bias
    p.check_vocab(16)
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 15\), got 15"):
        p.check_vocab(15)


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


def test_a_top_k_past_the_vocabulary_filters_nothing() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    seen = {Sampler()(logits, [SamplingParams(top_k=1000)], [None]).token_ids[0] for _ in range(200)}
    assert seen == {0, 1, 2}


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


def test_logit_bias_ban_under_greedy_is_never_chosen() -> None:
    logits = _logits(rows=4)
    top = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0, logit_bias={t: -100}) for t in top]
    out = Sampler()(logits, params, [None] * 4)
    assert all(chosen != banned for chosen, banned in zip(out.token_ids, top, strict=True))
    # The runner-up is what greedy picks once the favourite is banned.
    runner_up = logits.topk(2, dim=-1).indices[:, 1].tolist()
    assert out.token_ids == runner_up
    # The model's logits are untouched (the bias goes into a copy).
    assert logits.argmax(-1).tolist() == top


def test_logit_bias_ban_under_sampling_is_never_chosen() -> None:
    # Two tokens with almost all the mass: banning one leaves the other, whatever the noise draws.
    logits = torch.tensor([[5.0, 5.0, -5.0, -5.0]]).repeat(500, 1)
    out = Sampler()(logits, [SamplingParams(temperature=1.0, logit_bias={0: -100})] * 500, [None] * 500)
    assert 0 not in out.token_ids and out.token_ids.count(1) > 450


def test_logit_bias_force_is_always_chosen_greedy_and_sampled() -> None:
    logits = _logits(rows=2, vocab=1000)
    forced = int(logits[0].argmin())
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.5, top_p=0.9, top_k=40)):
        params.logit_bias = {forced: 100.0}
        for _ in range(20):
            assert Sampler()(logits[:1], [params], [None]).token_ids == [forced]


def test_logit_bias_in_a_mixed_batch_stays_in_its_row() -> None:
    logits = _logits(rows=4, vocab=50)
    top = logits.argmax(-1).tolist()
    params = [
        SamplingParams(temperature=0, logit_bias={7: 100}),  # forced
        SamplingParams(temperature=0),  # untouched
        SamplingParams(temperature=0, logit_bias={top[2]: -100}),  # banned
        SamplingParams(temperature=1.0, logit_bias={9: 100, top[3]: -100}),  # sampled, forced
    ]
    for _ in range(10):
        out = Sampler()(logits, params, [None] * 4)
        assert out.token_ids[0] == 7
        assert out.token_ids[1] == top[1]
        assert out.token_ids[2] == logits[2].topk(2).indices[1].item()
        assert out.token_ids[3] == 9


def test_logprobs_are_of_the_biased_distribution() -> None:
    logits = _logits(rows=1)
    bias = {3: 100.0, 4: -100.0}
    out = Sampler()(logits, [SamplingParams(temperature=0, logprobs=2, logit_bias=bias)], [None])
    biased = logits.clone()
    biased[0, 3] += 100
    biased[0, 4] -= 100
    ref = torch.log_softmax(biased, -1)
    assert out.token_ids == [3]
    assert math.isclose(out.logprobs[0], ref[0, 3].item(), rel_tol=1e-6, abs_tol=1e-6)
    assert [t for t, _ in out.top_logprobs[0]] == ref[0].topk(2).indices.tolist()


def test_penalties_lower_each_output_token_once_for_presence_and_per_occurrence_for_frequency() -> None:
    logits = torch.zeros(3, 8)
    params = [
        SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25, logprobs=0),
        SamplingParams(temperature=0, logprobs=0),  # not penalized: its output is not read
        SamplingParams(temperature=0, presence_penalty=-1.0, logprobs=0),  # negative: encourages
    ]
    outputs = [[3, 3, 5], [0, 0, 0], [7]]
    history = [(out, 0) for out in outputs]
    penalized = apply_penalties(logits, params, history)
    assert penalized[0].tolist() == [0, 0, 0, -1.0, 0, -0.75, 0, 0]
    assert penalized[1].tolist() == [0.0] * 8
    assert penalized[2].tolist() == [0, 0, 0, 0, 0, 0, 0, 1.0]
    assert logits.abs().sum() == 0  # the model's logits are left alone
    assert apply_penalties(logits, [SamplingParams()] * 3, history) is logits  # nobody penalized: no copy

    # Through the sampler: greedy moves off the repeated token; logprobs are of the penalized rows.
    scores = torch.tensor([[2.0, 1.9, 0.0], [2.0, 1.9, 0.0]])
    rows = [SamplingParams(temperature=0, frequency_penalty=0.2, logprobs=0), SamplingParams(temperature=0)]
    out = Sampler()(scores, rows, [None, None], history=[([0], 0), ([0], 0)])
    assert out.token_ids == [1, 0]
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(torch.tensor([1.8, 1.9, 0.0]), -1)[1].item())


def test_penalties_survive_the_pd_json_round_trip() -> None:
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25)
    again = SamplingParams(**json.loads(json.dumps(dataclasses.asdict(p)))).for_first_token()
    assert (again.presence_penalty, again.frequency_penalty) == (0.5, -0.25) and again.penalized
    assert not SamplingParams().penalized


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output() -> None:
    logits = torch.tensor([[2.0, -1.0, 4.0, 3.0, -2.0]])
    # Tokens 0 and 1 are the prompt, 2 the output; 3 and 4 were never seen.
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5)
    penalized = apply_penalties(logits, [p], [([0, 1, 2], 2)])
    # Repetition first (over prompt and output), then presence (over the output only).
    assert penalized[0].tolist() == [1.0, -2.0, 1.5, 3.0, -2.0]


def test_min_p_drops_tokens_less_likely_than_its_share_of_the_best() -> None:
    # Probabilities about 0.64, 0.24, 0.09, 0.03: min_p 0.2 keeps the first two (0.24 >= 0.128).
    logits = torch.log(torch.tensor([[0.64, 0.24, 0.09, 0.03]])).repeat(200, 1)
    params = [SamplingParams(temperature=1.0, min_p=0.2)] * 200
    out = Sampler()(logits, params, [make_generator(i) for i in range(200)])
    assert set(out.token_ids) == {0, 1}
    free = Sampler()(logits, [SamplingParams(temperature=1.0)] * 200, [make_generator(i) for i in range(200)])
    assert set(free.token_ids) - {0, 1}  # without it the tail is drawn too


def test_generation_config_gives_the_defaults_vllm_reads_and_bad_values_name_the_file(tmp_path: Path) -> None:
    assert read_generation_config(tmp_path) == SamplingDefaults()  # no file: OpenAI's
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": -1, "do_sample": True, "max_new_tokens": 9})
    )
    defaults = read_generation_config(tmp_path)
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.95)
    assert defaults.changed() == {"temperature": 0.6, "top_p": 0.95}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 7, "min_p": 0.1}))
    with pytest.raises(ValueError, match=r"generation_config.json: .*temperature.*must be in \[0, 2\]"):
        read_generation_config(tmp_path)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"generation_config\.json: not readable JSON"):
        read_generation_config(tmp_path)
