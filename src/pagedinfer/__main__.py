"""``python -m pagedinfer`` runs the command line."""

import sys

from pagedinfer.cli import main

sys.exit(main())
