"""A stand-in for the `aws` command the weights fetch script calls in the amazon/aws-cli image,
for the one call it makes, done with boto3 against the tests' S3 server (moto):

    aws --endpoint-url E --region R s3api get-object --bucket B --key K \
        [--version-id V] [--query '[VersionId,ETag]' --output text] OUTFILE

An option the real CLI does not take there is refused as it refuses it ("Unknown options: ...",
exit 255: awscli 1.46.3 clidriver.py; its global options are awscli/data/cli.json's, and
--only-show-errors is only the `aws s3` transfer commands', awscli/customizations/s3/subcommands.py).

With --query, the answer's VersionId and ETag as the aws CLI prints them with --output text
(tab-separated); without, the CLI's JSON answer (nothing the script reads). The real CLI is not
installable beside this project's boto3 (awscli pins an older botocore; the twin runs it from a
virtualenv of its own, twin/init_containers.py fetcher_venv). Every call is logged
to $AWS_STANDIN_LOG, one line each, its arguments as given."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import boto3


def pause_after_the_first_weight_file(folder: Path) -> None:
    """$AWS_STANDIN_PAUSE: after writing the first weight file, say so (`paused` in that folder)
    and wait until the test says `go`: another fetch runs whole in between."""
    if (folder / "paused").exists():
        return
    (folder / "paused").touch()
    while not (folder / "go").exists():
        time.sleep(0.05)


OPTIONS = {"--endpoint-url", "--region", "--query", "--output",  # global (awscli/data/cli.json)
           "--bucket", "--key", "--version-id"}  # s3api get-object's


def main(argv: list[str]) -> int:
    opts, rest = {}, []
    it = iter(argv)
    for a in it:
        if a.startswith("--"):
            if a not in OPTIONS:
                print(f"usage: aws [options] <command> <subcommand> [<subcommand> ...] [parameters]\n"
                      f"Unknown options: {a}", file=sys.stderr)
                return 255
            opts[a] = next(it)
        else:
            rest.append(a)
    if os.environ.get("AWS_STANDIN_LOG"):
        with open(os.environ["AWS_STANDIN_LOG"], "a") as log:
            log.write(" ".join(argv) + "\n")
    s3 = boto3.client("s3", endpoint_url=opts["--endpoint-url"], region_name=opts["--region"])
    service, op = rest[0], rest[1]
    if (service, op) == ("s3api", "get-object"):
        version = {"VersionId": opts["--version-id"]} if "--version-id" in opts else {}
        got = s3.get_object(Bucket=opts["--bucket"], Key=opts["--key"], **version)
        with open(rest[2], "wb") as out:
            for chunk in got["Body"].iter_chunks():
                out.write(chunk)
        if version and os.environ.get("AWS_STANDIN_PAUSE"):
            pause_after_the_first_weight_file(Path(os.environ["AWS_STANDIN_PAUSE"]))
        print(f"{got.get('VersionId', 'None')}\t{got['ETag']}" if "--query" in opts else "{}")
    else:
        print(f"aws stand-in: {service} {op} is not a call the fetch script makes", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
