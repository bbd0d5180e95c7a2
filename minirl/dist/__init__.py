"""Processes and devices: the data/sequence-parallel context, device transfers, signals, the SPMD
start (process group, mesh) and the launchers that start the ranks (local, torchrun; Ray is a
plugin). May import `errors`, `protocols` and the plugin manager, nothing of the training step."""
