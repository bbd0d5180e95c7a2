"""The models: loading (a local Hugging Face directory or a random-weight preset, and its
tokenizer), presets, tokenizers, the packed varlen attention (attention, varlen), and the steps
that turn a plain model into the actor, the reference or the critic (assembly: compile, fused_mlp).

    from minirl.models.loading import load_model
    from minirl.models.attention import packed_forward_kwargs
    model, tokenizer = load_model(cfg.model, device, dtype)
    logits = model(input_ids=ids_1N, **packed_forward_kwargs(seq_lens, device)).logits
"""
