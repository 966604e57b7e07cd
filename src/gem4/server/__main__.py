"""`python -m gem4.server MODEL [options]`: the same as `gem4 serve`."""
import sys

from gem4.server.main import main

sys.exit(main())
