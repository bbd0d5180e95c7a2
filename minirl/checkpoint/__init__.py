"""Checkpoints: full resumable training state (`state`, `store`, `resume`, `training`) and the
Hugging Face export of the actor (`hf`). A resume is exact: the same metrics and weights as a run
that was never interrupted (tests/integration/test_resume.py)."""
