"""The job config: the schema of every section (`schema`) and loading it from TOML files,
profiles and command-line overrides (`load`). Imports nothing of minirl but `errors`."""
