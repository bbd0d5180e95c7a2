"""The update: the PPO epoch / mini-batch / micro-batch loop written once, with the actor's
micro-batch loss; the critic supplies its own (minirl.critic). May import `forward`, `algo`,
`models`, `dist`, `batch`."""
