"""Batched sampling: greedy, temperature, top-k, top-p, seeds, raw logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from inference_svc.engine.sampling import SampleOutput, SamplingParams, make_generator, sample

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])  # [1, V=6], distinct, sorted
RAW_LOGPROBS = torch.log_softmax(LOGITS[0], dim=-1)


def _frequencies(params: SamplingParams, draws: int = 3000, seed: int = 0) -> torch.Tensor:
    generator = make_generator(seed)
    counts = torch.zeros(LOGITS.shape[1])
    for _ in range(draws):
        counts[sample(LOGITS, [params], [generator]).token_ids[0]] += 1
    return counts / draws


def test_greedy_takes_argmax_with_raw_logprobs() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    out = sample(logits, [SamplingParams()] * 5, [make_generator(0)] * 5)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    want = torch.log_softmax(logits, -1).gather(1, out.token_ids[:, None])[:, 0]
    assert torch.allclose(out.logprobs, want, atol=0, rtol=0)
    assert out.token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_host_copy_equals_tolist_of_each(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    token_ids = torch.tensor([0, 7, 129279, 2**40], device=device)
    logprobs = torch.tensor(
        [-0.1, float("-inf"), -1e-30, float("nan")], dtype=torch.float32, device=device
    )
    want_ids, want = token_ids.tolist(), logprobs.tolist()
    on_host = SampleOutput(token_ids, logprobs).start_host_copy()
    # Work queued after the copy (the next step) does not change what it reads back.
    token_ids.fill_(-1)
    logprobs.fill_(0.0)
    ids, values = on_host.to_lists()
    assert ids == want_ids and all(type(i) is int for i in ids)
    assert values[:3] == want[:3] and math.isnan(values[3]) and math.isnan(want[3])
    assert all(type(v) is float for v in values)
    assert SampleOutput(token_ids[:0], logprobs[:0]).start_host_copy().to_lists() == ([], [])


def test_temperature_one_follows_softmax() -> None:
    freq = _frequencies(SamplingParams(temperature=1.0))
    assert torch.allclose(freq, RAW_LOGPROBS.exp(), atol=0.03)


def test_temperature_sharpens_but_logprobs_stay_raw() -> None:
    params = SamplingParams(temperature=0.5)
    freq = _frequencies(params)
    assert torch.allclose(freq, torch.softmax(LOGITS[0] / 0.5, -1), atol=0.03)
    out = sample(LOGITS, [params], [make_generator(1)])
    assert out.logprobs[0] == RAW_LOGPROBS[out.token_ids[0]]


def test_top_k_keeps_the_k_most_likely() -> None:
    freq = _frequencies(SamplingParams(temperature=1.0, top_k=2))
    top2 = torch.softmax(LOGITS[0, :2], -1)
    assert torch.allclose(freq[:2], top2, atol=0.03) and freq[2:].sum() == 0
    assert _frequencies(SamplingParams(temperature=5.0, top_k=1), draws=50)[0] == 1


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = RAW_LOGPROBS.exp()  # ≈ [0.57, 0.21, 0.13, 0.08, 0.03, 0.004]
    top_p = float(probs[:2].sum()) + 0.01  # needs the third token as well
    freq = _frequencies(SamplingParams(temperature=1.0, top_p=top_p))
    assert torch.allclose(freq[:3], probs[:3] / probs[:3].sum(), atol=0.03)
    assert freq[3:].sum() == 0
    only_first = _frequencies(SamplingParams(temperature=1.0, top_p=0.1), draws=50)
    assert only_first[0] == 1


def test_top_k_then_top_p() -> None:
    # top_k=3 renormalises over 3 tokens; top_p=0.7 of that keeps the first two.
    freq = _frequencies(SamplingParams(temperature=1.0, top_k=3, top_p=0.7))
    assert freq[2:].sum() == 0 and freq[:2].sum() == 1


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
def test_same_seed_same_tokens_regardless_of_batch(device: str) -> None:
    """A seeded request draws the same tokens alone and in two different batches."""
    gen = torch.Generator().manual_seed(1)
    vocab, steps = 40, 12
    step_logits = [torch.randn(vocab, generator=gen).to(device) for _ in range(steps)]
    mine = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=1234)
    others = [SamplingParams(), SamplingParams(temperature=1.3, seed=7), SamplingParams(1.0)]

    def run(
        mine: SamplingParams, batch_position: int, neighbours: list[SamplingParams]
    ) -> list[int]:
        generators = [make_generator(p.seed, device) for p in neighbours]
        my_generator = make_generator(mine.seed, device)
        tokens = []
        for logits in step_logits:
            rows = [torch.randn(vocab, generator=gen).to(device) for _ in neighbours]
            rows.insert(batch_position, logits)
            params = list(neighbours)
            params.insert(batch_position, mine)
            gens = list(generators)
            gens.insert(batch_position, my_generator)
            out = sample(torch.stack(rows), params, gens)
            tokens.append(int(out.token_ids[batch_position]))
        return tokens

    alone = run(mine, 0, [])
    assert run(mine, 2, others) == alone
    assert run(mine, 1, others[::-1][:2]) == alone
    assert len(set(alone)) > 1  # it really sampled
    assert run(SamplingParams(0.9, 20, 0.95, seed=99), 0, []) != alone


def test_unseeded_generators_differ() -> None:
    assert make_generator(None).initial_seed() != make_generator(None).initial_seed()
    assert make_generator(2**64 - 1).initial_seed() == 2**64 - 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_k": -1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"seed": -1},
    ],
)
def test_params_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="logits must be"):
        sample(torch.zeros(2, 4), [SamplingParams()], [make_generator(0)])
