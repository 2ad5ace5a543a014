"""Shared fixtures: a very small config so end-to-end runs take seconds."""

import pytest

TINY_TEST_YAML = """\
seed: 0
method: {name: grpo}
model: {hidden_size: 32, num_layers: 1, num_heads: 2, num_kv_heads: 1, intermediate_size: 64}
task: {name: arithmetic, digits: 1, n_test: 16}
warmstart: {steps: 40, batch_size: 16}
rollout: {prompts_per_step: 6, n: 4, max_new_tokens: 4, logprobs_k: 5}
train: {steps: 2, checkpoint_every: 1, lr: 1.0e-3}
"""


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "tiny_test.yaml"
    path.write_text(TINY_TEST_YAML)
    return path
