"""A stand-in for the `aws` command the weights fetch script calls in the amazon/aws-cli image,
for the three calls it makes, done with boto3 against the tests' S3 server (moto):

    aws --only-show-errors --endpoint-url E --region R s3 cp s3://B/KEY DEST
    aws ... s3api head-object --bucket B --key K --query '[VersionId,ETag]' --output text
    aws ... s3api list-objects-v2 --bucket B --prefix P --query 'Contents[].[Key,ETag,Size]' --output text

Text output as the aws CLI prints it with --output text: one row per item, tab-separated. The
real CLI is not installable beside this project's boto3 (awscli pins an older botocore).
Every call is logged to $AWS_STANDIN_LOG, one line each."""

from __future__ import annotations

import os
import sys

import boto3


def main(argv: list[str]) -> int:
    opts, rest = {}, []
    it = iter(argv)
    for a in it:
        if a.startswith("--") and a not in ("--only-show-errors",):
            opts[a] = next(it)
        elif a != "--only-show-errors":
            rest.append(a)
    if os.environ.get("AWS_STANDIN_LOG"):
        with open(os.environ["AWS_STANDIN_LOG"], "a") as log:
            log.write(" ".join(rest) + "\n")
    s3 = boto3.client("s3", endpoint_url=opts["--endpoint-url"], region_name=opts["--region"])
    service, op = rest[0], rest[1]
    if (service, op) == ("s3", "cp"):
        bucket, _, key = rest[2].removeprefix("s3://").partition("/")
        s3.download_file(bucket, key, rest[3])
    elif (service, op) == ("s3api", "head-object"):
        head = s3.head_object(Bucket=opts["--bucket"], Key=opts["--key"])
        print(f"{head.get('VersionId', 'None')}\t{head['ETag']}")
    elif (service, op) == ("s3api", "list-objects-v2"):
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=opts["--bucket"], Prefix=opts["--prefix"]):
            for item in page.get("Contents", []):
                print(f"{item['Key']}\t{item['ETag']}\t{item['Size']}")
    else:
        print(f"aws stand-in: {service} {op} is not a call the fetch script makes", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
