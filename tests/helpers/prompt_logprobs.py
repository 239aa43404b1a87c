"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' log-softmax of
the fp32 logits of the same prompt."""

import pytest
import torch


def hf_prompt_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    """Row i: transformers' log-softmax at position i (it predicts prompt token i + 1)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def check_against_transformers(path: str, prompt: list[int], got, k: int) -> None:
    ref = hf_prompt_logprobs(path, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        entry, row, token = got[i], ref[i - 1], prompt[i]
        assert next(iter(entry)) == token                  # the prompt token first, as vLLM
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        # (a random model's logits are close: a neighbour within float error may swap)
        lp = row[token].item()
        assert int((row > lp + 1e-5).sum()) + 1 <= entry[token].rank <= int((row > lp - 1e-5).sum()) + 1
        top = row.topk(k).indices.tolist() if k else []
        assert set(entry) == {token} | set(top) and len(entry) <= k + 1
        for rank, t in enumerate(top, start=1):
            assert entry[t].logprob == pytest.approx(row[t].item(), abs=1e-4)
            if t != token:
                assert abs(entry[t].rank - rank) <= 1
