"""``python -m selfspec.bench ...`` = ``selfspec bench ...``."""

import sys

from selfspec.base.errors import run_command
from selfspec.bench.cli import main

sys.exit(run_command("selfspec bench", main, sys.argv[1:]))
