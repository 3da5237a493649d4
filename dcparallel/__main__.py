import sys

from dcparallel.cli import main

sys.exit(main())
