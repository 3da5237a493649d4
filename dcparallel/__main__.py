"""`python -m dcparallel`: the `dcparallel` command line (`dcparallel.apps.cli`)."""

import sys

from dcparallel.apps.cli import main

sys.exit(main())
