"""`python -m sovereign_runtime ...` is the same as `sovereign-runtime ...`."""

import sys

from .program import main

sys.exit(main())
