"""``python -m gradscaler``."""

import sys

from gradscaler.cli import main

sys.exit(main())
