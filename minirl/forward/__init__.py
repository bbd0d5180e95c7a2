"""The packed forward: prompt + response rows packed into one sequence, run through a model
with a head function (log-probs, entropies, values, hidden states), and the chunked log-prob
head itself. May import `models`, `kernels`, `dist`, `batch`."""
