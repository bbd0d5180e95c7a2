"""Model loading: local Hugging Face directories, random-weight presets, tokenizers, attention."""
