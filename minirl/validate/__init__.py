"""The validation pass: every rule on user input (config values, files, the data-parallel
layout, token budgets, the critic section), checked once before any process starts, each problem
one line naming the key or the input; the code that runs the job asserts these rules at most.
Entry point: `minirl.validate.core.validate` (and `check_world`, for a launcher that learns the
number of workers only when it starts). The only layer that may import from every other to ask
what is valid; no other layer imports it but the CLI."""
