"""`python -m minirl --config FILE` runs a job; `python -m minirl plugins` lists the plugins."""

from minirl.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
