"""Built-in loggers: console, jsonl, tensorboard, wandb."""
