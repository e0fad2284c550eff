"""``python -m selfspec ...`` = ``selfspec ...``."""

import sys

from selfspec.cli import main

sys.exit(main())
