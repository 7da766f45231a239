"""`python -m asyncflow` runs the CLI."""

import sys

from asyncflow.cli import main

sys.exit(main())
