"""Built-in algorithm components: advantage estimators, KL estimators, policy losses, optimizers."""
