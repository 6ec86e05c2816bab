"""`python -m sovereign_runtime ...` is the same as `sovereign-runtime ...`."""

import sys

from .cli import main

sys.exit(main())
