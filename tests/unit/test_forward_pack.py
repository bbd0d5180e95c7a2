"""minirl.forward.pack: one packed row, its lengths, the positions that predict each response
token and those tokens, equal to building them sequence by sequence."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirl.forward import pack

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
    assert pred_pos_R.dtype == torch.long and pred_pos_R.tolist() == pred_pos
    assert labels_R.dtype == torch.long and labels_R.tolist() == labels
    # each predicting position holds the token just before its label
    assert all(ids[pos + 1] == label for pos, label in zip(pred_pos, labels))
