"""Where a step's batch comes from: the prompts' trajectories turned into the batch
(`trajectories`), generated on the trainer's own ranks and scored (`collocated`), refilled by
dynamic sampling (`dynamic_sampling`). May import everything below the trainer."""
