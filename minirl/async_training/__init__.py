"""Asynchronous off-policy training: rollout ranks that generate while trainer ranks train (docs/async.md)."""
