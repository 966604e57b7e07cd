"""`python -m gem4 ...`: the same as the `gem4` command."""
import sys

from gem4.cli import main

sys.exit(main())
