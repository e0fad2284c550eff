"""``python -m selfspec.bench ...`` = ``selfspec bench ...``."""

import sys

from selfspec.bench.cli import main

sys.exit(main())
