"""The algorithm's tensor math around the estimators: loss aggregation, KL control, rollout
correction (TIS), dynamic sampling, masked statistics and the non-finite guard. Pure torch on
[B, T] tensors; may import `batch`, `protocols`, `errors` and `dist`, no model code."""
