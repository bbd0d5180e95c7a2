"""minirl's attention for packed sequences, registered with transformers as `attn_implementation="minirl"`.

Training and log-prob forwards run one packed row with no padding: input_ids [1, N], position_ids
restarting at 0 for every sequence, and the cumulative sequence lengths, all from
`packed_forward_kwargs(seq_lens)`. transformers hands `cu_seq_lens_q` / `max_length_q` through
every decoder layer to the attention function, which calls the varlen core `varlen_attention`
(minirl/models/varlen.py).
Calls without cu_seq_lens (generate, padded batches) take a plain SDPA path.

Shape legend: N packed tokens, S sequences, H query heads, K key/value heads, D head dim,
B batch rows, Q query length, L key length.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from minirl.dist.transfer import to_device
from minirl.models.varlen import repeat_kv, varlen_attention

ATTN_NAME = "minirl"
STAND_IN_MASK_SHAPE = (1, 1, 0, 0)


# ---------------------------------------------------------------------------------------------
# caller side
# ---------------------------------------------------------------------------------------------


def packed_forward_kwargs(
    seq_lens: Sequence[int] | torch.Tensor, device: torch.device | str | None = None, stand_in_mask: bool = False
) -> dict:
    """The kwargs that make a Hugging Face causal LM treat one [1, N] row as S separate sequences.

    position_ids restart at 0 per sequence (RoPE as in the unpacked forward); cu_seq_lens_q/k are
    int32 boundaries [S+1]; max_length_q/k are Python ints, so no kernel call syncs to find them;
    use_cache=False stores no keys and values that nobody reads.

    stand_in_mask: for an attention that reads the boundaries from cu_seq_lens alone (minirl's,
    Ulysses'), also pass an empty 4-D `attention_mask` (STAND_IN_MASK_SHAPE). transformers takes a
    4-D mask as prepared, so it skips its packed-sequence detection, which reads a value back from
    the device in every forward: a host sync that let the device run dry at the start of each
    micro-batch (docs/benchmarks-history.md). Any other attention fails on the empty shape rather
    than attend across sequences; sdpa and eager models get no stand-in.
    """
    lens_S = torch.as_tensor(seq_lens, dtype=torch.int64).cpu()
    if lens_S.ndim != 1 or lens_S.numel() == 0 or bool((lens_S <= 0).any()):
        raise ValueError(f"seq_lens must be a non-empty list of positive lengths, got {seq_lens!r}")
    cu_S1 = torch.zeros(lens_S.numel() + 1, dtype=torch.int32)
    cu_S1[1:] = lens_S.cumsum(0)
    starts_N = torch.repeat_interleave(cu_S1[:-1].long(), lens_S)
    position_ids_1N = (torch.arange(int(cu_S1[-1])) - starts_N).unsqueeze(0)
    max_len = int(lens_S.max())
    cu_S1 = to_device(cu_S1, device)
    kwargs = {
        "position_ids": to_device(position_ids_1N, device),
        "cu_seq_lens_q": cu_S1,
        "cu_seq_lens_k": cu_S1,
        "max_length_q": max_len,
        "max_length_k": max_len,
        "use_cache": False,
    }
    if stand_in_mask:
        kwargs["attention_mask"] = torch.empty(STAND_IN_MASK_SHAPE, dtype=torch.bool, device=device)
    return kwargs


def register_attention() -> None:
    """Register "minirl" with transformers' attention and mask interfaces (idempotent). The mask
    function keeps transformers from materialising a dense [B, 1, Q, L] mask: packed rows need
    none, and padded batches (generate) get the 2-D padding mask, made an SDPA mask here."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, minirl_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, padding_mask_only)


def padding_mask_only(
    batch_size: int, q_length: int, kv_length: int, attention_mask: torch.Tensor | None = None, **kwargs
) -> torch.Tensor | None:
    """transformers' mask hook for "minirl": the 2-D padding mask [B, L], or None without padding."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


# ---------------------------------------------------------------------------------------------
# the attention function transformers calls
# ---------------------------------------------------------------------------------------------


@torch.compiler.disable
def minirl_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, Q, D]
    key: torch.Tensor,  # [B, K, L, D]
    value: torch.Tensor,  # [B, K, L, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' AttentionInterface signature; returns ([B, Q, H, D], no attention weights).

    Always eager: a compiled decoder layer (model.compile_layers) breaks its graph at this call.
    Inside, there is nothing to fuse (checks, views and the varlen kernel), and compiled it was
    two more graphs per pass kind, whose input strides (a size-1 batch dimension's, which the
    graph before it leaves free) made them differ between processes (minirl.precompile)."""
    if dropout:
        raise ValueError(
            f"attn_implementation='minirl' has no attention dropout (got {dropout}); "
            "set the model config's attention_dropout to 0.0"
        )
    if sliding_window is not None:
        raise ValueError(
            "attn_implementation='minirl' has no sliding-window attention; set the "
            "model config's use_sliding_window = false or use attn_implementation='sdpa'"
        )
    cu_S1, max_len = _packed_boundaries(query, key, attention_mask, kwargs)
    if cu_S1 is None:
        return _padded_sdpa(query, key, value, attention_mask, scaling), None
    q_NHD, k_NKD, v_NKD = (x[0].transpose(0, 1) for x in (query, key, value))
    out_NHD = varlen_attention(q_NHD, k_NKD, v_NKD, cu_S1, int(max_len), scaling)
    return out_NHD.unsqueeze(0), None


def _packed_boundaries(query, key, attention_mask, kwargs) -> tuple[torch.Tensor | None, int]:
    """cu_seqlens of a packed row: passed in, or (slow, one sync) derived from restarting positions."""
    cu_S1 = kwargs.get("cu_seq_lens_q")
    if cu_S1 is not None:
        if query.shape[0] != 1 or query.shape[2] != key.shape[2]:
            raise ValueError(
                f"cu_seq_lens_q needs one packed row without a KV cache; got query "
                f"{tuple(query.shape)}, key {tuple(key.shape)} (pass use_cache=False)"
            )
        max_len = kwargs.get("max_length_q")
        return cu_S1, int(max_len) if max_len is not None else int((cu_S1[1:] - cu_S1[:-1]).max())
    position_ids = kwargs.get("position_ids")
    packable = attention_mask is None and query.shape[0] == 1 and query.shape[2] == key.shape[2]
    if not packable or position_ids is None or position_ids.shape[-1] != query.shape[2]:
        return None, 0
    return _boundaries_from_positions(position_ids.reshape(-1))


def _boundaries_from_positions(position_ids_N: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A new sequence starts wherever the position does not continue the previous one."""
    starts_N = torch.ones_like(position_ids_N, dtype=torch.bool)
    starts_N[1:] = position_ids_N[1:] != position_ids_N[:-1] + 1
    n = position_ids_N.numel()
    cu_S1 = torch.cat([starts_N.nonzero().flatten(), position_ids_N.new_tensor([n])]).to(torch.int32)
    return cu_S1, int((cu_S1[1:] - cu_S1[:-1]).max())


# ---------------------------------------------------------------------------------------------
# unpacked batches (generate, padded inputs)
# ---------------------------------------------------------------------------------------------


def _padded_sdpa(query, key, value, attention_mask, scale) -> torch.Tensor:
    """SDPA over [B, H, Q, D] with queries aligned to the end of the keys (KV-cache decoding)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    key, value = repeat_kv(key, query.shape[1]), repeat_kv(value, query.shape[1])
    mask, is_causal = None, False
    if attention_mask is not None and attention_mask.ndim == 4:  # a caller's prepared mask
        mask = attention_mask[..., :kv_len]
    elif attention_mask is not None:
        mask = _causal_padding_mask(attention_mask[:, -kv_len:].bool(), q_len, kv_len, query.device)
    elif q_len == kv_len:
        is_causal = q_len > 1
    elif q_len > 1:
        mask = _causal_padding_mask(None, q_len, kv_len, query.device)
    out_BHQD = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=is_causal, scale=scale)
    return out_BHQD.transpose(1, 2).contiguous()


def _causal_padding_mask(pad_BL, q_len, kv_len, device) -> torch.Tensor:
    """Boolean [B|1, 1, Q, L]: causal (bottom-right aligned) and not padding (pad_BL, or None).

    Every query may also see itself, so a padding query never has an all-masked row: SDPA would
    return NaN there, and NaN values times zero weights would leak into real tokens' outputs.
    """
    q_pos_Q1 = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos_1L = torch.arange(kv_len, device=device)[None, :]
    allowed_QL = k_pos_1L <= q_pos_Q1
    if pad_BL is None:
        return allowed_QL[None, None]
    return (allowed_QL[None] & pad_BL[:, None, :] | (k_pos_1L == q_pos_Q1)[None])[:, None]
