"""minillm's command line, from a checkout: `python cli.py generate --prompt "..."`.

The commands live in minillm/cli.py; installed, `minillm ...` runs the same `main`."""

import sys

from minillm.cli import main

if __name__ == "__main__":
    sys.exit(main())
