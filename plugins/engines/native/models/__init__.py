"""Part of the native rollout engine; see minirl_plugins.engines.native."""
