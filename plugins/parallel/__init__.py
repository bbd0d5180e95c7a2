"""Built-in parallelism: FSDP2 data parallelism, Ulysses sequence parallelism, activation
checkpointing."""
