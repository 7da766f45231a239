"""`asyncflow tinker-serve` on the real SmolLM2-135M-Instruct, driven by the official `tinker` SDK, with
streaming on (samplers at most one step behind): supervised steps lower the loss of a chat reply, an
RL loop raises the reward, and a saved state loads back into a new client."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
from tinker import types

from asyncflow.tinker.build import make_service
from asyncflow.tinker.server import start
from asyncflow.tinker.settings import ServeSettings

pytestmark = pytest.mark.slow
QUESTION = "What is 2 + 3? Answer with a number."


@pytest.fixture(scope="module")
def client(smollm2_dir: Path) -> Iterator[Any]:
    os.environ["TINKER_TELEMETRY"] = "0"
    service = make_service(ServeSettings(smollm2_dir, device="cpu", max_staleness=1))
    server, _ = start(service, "127.0.0.1", 0)
    with tinker.ServiceClient(base_url=f"http://127.0.0.1:{server.server_address[1]}", api_key="tml-test") as sdk:
        yield sdk
    server.shutdown()
    server.server_close()
    service.shutdown()


def chat_prompt(tokenizer: Any) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                         tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def reply_datum(prompt: list[int], reply: list[int]) -> types.Datum:
    tokens = prompt + reply
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(reply)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


def test_smollm2_supervised_steps_lower_the_loss_and_a_saved_state_loads_back(client: Any) -> None:
    tc = client.create_lora_training_client(base_model="SmolLM2-135M-Instruct", rank=8, seed=0).result()
    tokenizer = tc.get_tokenizer()
    prompt = chat_prompt(tokenizer)
    data = [reply_datum(prompt, tokenizer.encode("The answer is 5.<|im_end|>", add_special_tokens=False))]
    losses = []
    for _ in range(4):
        losses.append(tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=2e-3)).result()
    final = tc.forward(data, "cross_entropy").result()
    assert final.metrics["loss:sum"] < 0.5 * losses[0], (losses, final.metrics)
    path = tc.save_state("sft").result().path
    loaded = client.create_training_client_from_state(path).result()
    again = loaded.forward(data, "cross_entropy").result()
    assert again.metrics["loss:sum"] == pytest.approx(final.metrics["loss:sum"], rel=1e-5)
    sampler = tc.save_weights_and_get_sampling_client().result()
    reply = sampler.sample(types.ModelInput.from_ints(prompt), 1,
                           types.SamplingParams(max_tokens=8, temperature=0.0)).result().sequences[0]
    assert tokenizer.decode(reply.tokens).startswith("The answer is 5")


def test_smollm2_rl_with_importance_sampling_raises_the_reward(client: Any) -> None:
    """Reward 1 for a reply that starts with the token "The" (about 1 in 8 replies at first); the expected
    reward, p("The" | prompt), is read exactly with compute_logprobs before every step."""
    tc = client.create_lora_training_client(base_model="SmolLM2-135M-Instruct", rank=8, seed=1).result()
    tokenizer = tc.get_tokenizer()
    prompt = chat_prompt(tokenizer)
    good = tokenizer.encode("The", add_special_tokens=False)[0]
    expected = []
    for step in range(5):
        sampler = tc.save_weights_and_get_sampling_client().result()
        expected.append(math.exp(sampler.compute_logprobs(types.ModelInput.from_ints(prompt + [good])).result()[-1]))
        group = sampler.sample(types.ModelInput.from_ints(prompt), 16,
                               types.SamplingParams(max_tokens=1, seed=step)).result().sequences
        rewards = np.array([float(s.tokens[0] == good) for s in group])
        n = len(prompt) - 1
        data = [types.Datum(model_input=types.ModelInput.from_ints(prompt + s.tokens[:-1]),
                            loss_fn_inputs={"target_tokens": prompt[1:] + s.tokens, "logprobs": [0.0] * n + s.logprobs,
                                            "advantages": [0.0] * n + [float(r - rewards.mean())] * len(s.tokens)})
                for s, r in zip(group, rewards, strict=True) if r != rewards.mean()]
        if data:
            tc.forward_backward(data, "importance_sampling").result()
            tc.optim_step(types.AdamParams(learning_rate=2e-3)).result()
    assert expected[-1] > expected[0] + 0.1, expected
