"""``python -m data_prep``: see data_prep.cli."""

import sys

from data_prep.cli import main

if __name__ == "__main__":
    sys.exit(main())
