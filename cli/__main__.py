"""`python -m cli ...`: the `registry` command."""

import sys

from cli.main import main

sys.exit(main())
