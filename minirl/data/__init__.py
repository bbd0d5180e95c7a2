"""Training prompts: reading parquet files in verl's schema, tokenising, filtering and the
resumable, per-rank loader. May import `config`, `errors`."""
