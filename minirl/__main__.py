"""`python -m minirl --config FILE` runs a job; `python -m minirl plugins` lists the plugins."""

import sys

try:
    from minirl.cli import main
except KeyboardInterrupt:  # Ctrl-C while torch imports: one line, the shell's 130, no traceback
    print("minirl: interrupted (Ctrl-C); stopped", file=sys.stderr)
    raise SystemExit(130) from None

if __name__ == "__main__":
    raise SystemExit(main())
