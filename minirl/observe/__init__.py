"""What a run shows: phase timers and FLOP counts (`metrics`), per-step metrics (`step_metrics`),
greedy validation (`evaluate`) and reading, comparing and plotting run directories (`runs`)."""
