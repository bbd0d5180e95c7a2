"""Rewards: scoring decoded responses (manager, scorers, custom file, worker pool), DAPO's
overlong shaping, placing scores on tokens and the step's reward metrics. May import `errors` and
the plugin manager."""
