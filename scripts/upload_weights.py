"""Upload a folder of model weights and its sha256 manifest to the spec's bucket.

    scripts/upload_weights --stack prod --source /data/DeepSeek-V3

Reads endpoint, bucket and prefix from the stack's spec; credentials come from the usual AWS
variables or profile. Makes the bucket private and versioned, and refuses one anyone may read
(an ACL grant, or a bucket policy: the store's verdict, or the policy read where the store has
none). Run through scripts/upload_weights, which uses the project's environment.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from botocore.exceptions import BotoCoreError, ClientError  # noqa: E402

from infra import weights  # noqa: E402
from infra.spec import SpecError, stack_spec_path  # noqa: E402
from infra.spec_checks import load_spec  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/upload_weights", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stack", default="dev", help="reads stacks/<stack>.yaml (default dev)")
    parser.add_argument("--spec", help="path of a spec file (overrides --stack)")
    parser.add_argument("--source", required=True, type=Path, help="local folder of weight files")
    parser.add_argument("--endpoint-url", help="S3 endpoint instead of the spec's (as the aws CLI's --endpoint-url)")
    parser.add_argument("--unreadable-bucket-policy-ok", action="store_true",
                        help="the store cannot say whether its bucket policy lets anyone read the weights (MinIO, "
                             "Ceph RGW answer NotImplemented), and you have checked it yourself")
    args = parser.parse_args()
    try:
        w = load_spec(Path(args.spec) if args.spec else stack_spec_path(args.stack)).model.weights
    except SpecError as exc:
        print(exc, file=sys.stderr)
        return 2
    if not args.source.is_dir():  # checked before any request: nothing is uploaded
        print(f"--source {args.source}: not a folder. Fix: the folder holding the weight files", file=sys.stderr)
        return 2
    try:
        return weights.main(["upload", "--endpoint", args.endpoint_url or w.endpoint_url, "--region", w.region,
                             "--bucket", w.bucket, "--prefix", w.prefix, "--source", str(args.source)]
                            + ["--unreadable-bucket-policy-ok"] * args.unreadable_bucket_policy_ok)
    except (BotoCoreError, ClientError) as exc:
        print(f"s3://{w.bucket}/{w.prefix}: {exc}. Fix: check the endpoint and this shell's AWS credentials",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
