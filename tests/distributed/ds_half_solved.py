"""A test plugin: the reward `half_solved` makes half of the copy prompts all-correct for any
model (even digits always score 1; odd digits score by the parity of the response's first
character, a coin flip for a random model). Used by test_dynamic_sampling_dp.py."""

from minirl import hookimpl


def half_solved(response, ground_truth, extra_info=None):
    if int(ground_truth) % 2 == 0:
        return 1.0
    return float(bool(response) and ord(response[0]) % 2 == 0)


@hookimpl
def minirl_reward_functions():
    return {"half_solved": half_solved}
