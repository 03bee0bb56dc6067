"""`python -m dgemma_compile.cli`: the `dgemma` console script."""

import sys

from . import main

sys.exit(main())
