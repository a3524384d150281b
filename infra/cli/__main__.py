"""`python -m infra.cli`: the same as `pdctl`."""

import sys

from infra.cli import main

sys.exit(main())
