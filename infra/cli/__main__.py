"""`python -m infra.cli`: the same as `pdctl`."""

import sys

from infra.cli.main import main

sys.exit(main())
