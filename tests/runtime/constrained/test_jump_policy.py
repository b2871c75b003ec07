"""JumpPolicy: a jump is taken when the forward passes it spares the jumping row (its share of the
batch's decode steps) outweigh what its extend step costs the whole batch over a decode step."""

from __future__ import annotations

import pytest

from radixlm.runtime.constrained.jump_forward import JumpPolicy


@pytest.mark.parametrize(("policy", "running", "want"), [
    (JumpPolicy(), 1, 1),  # free (the CPU): every jump
    (JumpPolicy(), 64, 1),
    (JumpPolicy(max_running=1), 2, None),  # an explicit cap
    (JumpPolicy(max_running=1), 1, 1),
    # an extend step 2.5 decode steps dearer: (gain + 1) / running > 2.5
    (JumpPolicy(decode_s=1e-3, penalty_s=2.5e-3), 1, 2),
    (JumpPolicy(decode_s=1e-3, penalty_s=2.5e-3), 4, 10),
    (JumpPolicy(decode_s=1e-3, penalty_s=3e-3), 1, 3),  # exactly 3: gain 2 only breaks even
    (JumpPolicy(decode_s=1e-3, penalty_s=0.2e-3), 1, 1),
    (JumpPolicy(decode_s=1e-3, penalty_s=3e-3, max_running=8), 16, None),
])
def test_min_gain(policy, running, want):
    assert policy.min_gain(running) == want


@pytest.mark.parametrize("running", [1, 3, 16, 64])
@pytest.mark.parametrize("ratio", [0.3, 1.0, 2.5, 4.0])
def test_min_gain_is_the_break_even_point(running, ratio):
    policy = JumpPolicy(decode_s=1.0, penalty_s=ratio)
    k = policy.min_gain(running)
    assert k is not None and k >= 1

    def saves(gain: int) -> bool:
        return (gain + 1) / running > ratio

    assert saves(k) or k == 1
    assert not saves(k - 1) or k == 1
