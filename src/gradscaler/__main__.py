"""``python -m gradscaler``."""

import sys

from gradscaler.tools.cli import main

sys.exit(main())
