"""pdstack's policy pack: `pulumi preview --policy-pack policy`. The rules live in infra/policy/."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project, for `infra`

from pulumi_policy import PolicyPack  # noqa: E402

from infra.policy.pack import PACK_NAME, policies  # noqa: E402

PolicyPack(name=PACK_NAME, policies=policies())  # serves the analyzer until the CLI stops it
