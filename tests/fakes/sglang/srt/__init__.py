"""Part of the fake sglang package (see sglang/__init__.py)."""
