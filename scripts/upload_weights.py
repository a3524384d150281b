#!/usr/bin/env python3
"""Upload a folder of model weights and its sha256 manifest to the spec's bucket.

    scripts/upload_weights --stack prod --source /data/DeepSeek-V3

Reads endpoint, bucket and prefix from stacks/<stack>.yaml; credentials come from the
usual AWS variables or profile. Makes the bucket private and versioned.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infra import weights  # noqa: E402
from infra.spec import load_spec, stack_spec_path  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--stack", default="dev")
parser.add_argument("--source", required=True)
args = parser.parse_args()
w = load_spec(stack_spec_path(args.stack)).model.weights
sys.exit(weights.main(["upload", "--endpoint", w.endpoint_url, "--region", w.region, "--bucket", w.bucket,
                       "--prefix", w.prefix, "--source", args.source]))
