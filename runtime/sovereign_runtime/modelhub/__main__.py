"""`python -m sovereign_runtime.modelhub`: `sovereign-runtime download` without importing torch."""

import sys

from .cli import main

sys.exit(main())
