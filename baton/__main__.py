"""`python -m baton`: the same as the `baton` command."""

import sys

from baton.cli import main

sys.exit(main())
