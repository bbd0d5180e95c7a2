"""`python -m minirl eval`: generation and scoring without training, on a checkpoint or a Hugging
Face directory (command.py), and the pass@k estimator (passk.py)."""
