"""The validation pass: every rule on user input (config values, files, the data-parallel
layout, the critic section), checked once before any process starts, each problem one line naming
the key or the input. The only layer that may import from every other to ask what is valid; no
other layer imports it but the CLI."""
