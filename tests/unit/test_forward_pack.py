"""minirl.forward.packed.pack: one packed row, its lengths, the positions that predict each response
token and those tokens, equal to building them sequence by sequence."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.forward.packed import pack, response_logprobs

tokens = st.lists(st.integers(0, 151_935), max_size=12)
pairs = st.lists(st.tuples(tokens.filter(len), tokens), min_size=1, max_size=8)  # prompts are never empty


def _pack_one_by_one(prompts, responses):
    ids, lens, pred_pos, labels, offset = [], [], [], [], 0
    for p, r in zip(prompts, responses):
        ids += p + r
        lens.append(len(p) + len(r))
        pred_pos += [offset + len(p) - 1 + t for t in range(len(r))]
        labels += r
        offset += len(p) + len(r)
    return ids, lens, pred_pos, labels


@settings(max_examples=200, deadline=None)
@given(pairs)
def test_pack_equals_building_each_sequence_in_turn(pairs):
    prompts, responses = [list(p) for p, _ in pairs], [list(r) for _, r in pairs]
    ids_1N, lens, pred_pos_R, labels_R = pack(prompts, responses, "cpu")
    ids, want_lens, pred_pos, labels = _pack_one_by_one(prompts, responses)
    assert ids_1N.shape == (1, len(ids)) and ids_1N.dtype == torch.long
    assert ids_1N[0].tolist() == ids and lens == want_lens
    assert pred_pos_R.dtype == np.int64 and pred_pos_R.tolist() == pred_pos
    assert labels_R.dtype == torch.long and labels_R.tolist() == labels
    # each predicting position holds the token just before its label
    assert all(ids[pos + 1] == label for pos, label in zip(pred_pos, labels))


def test_the_predicting_positions_stay_a_host_array():
    """split places them; a sequence-parallel split cuts its slices by them without a read-back.
    A numpy array, not a CPU tensor: FSDP2's root forward would copy a tensor argument to the
    device with a blocking copy."""
    ids_1N, _, pred_pos_R, labels_R = pack([[1, 2], [3]], [[4, 5], [6]], "meta")
    assert ids_1N.device.type == labels_R.device.type == "meta"
    assert isinstance(pred_pos_R, np.ndarray) and pred_pos_R.tolist() == [1, 2, 4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("preset", ["tiny", "llama3-tiny"])
def test_a_packed_log_prob_pass_never_waits_for_the_device(preset):
    """Under torch's sync debug mode a forward that read a value back (transformers' packing
    detection did, once per forward) raises; minirl's packed forward must not."""
    from minirl.models.loading import random_model
    from minirl.models.presets import preset_config

    model = random_model(preset_config(preset), "cuda", torch.bfloat16, seed=0)
    prompts, responses = [[5, 6, 7], [8, 9]], [[10, 11, 12, 13], [14]]
    with torch.no_grad():
        want, _ = response_logprobs(model, prompts, responses, 1.0, torch.device("cuda"))  # warm-up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got, _ = response_logprobs(model, prompts, responses, 1.0, torch.device("cuda"))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
