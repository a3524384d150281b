"""A test stand-in for pulumi-random's provider plugin, for the real Pulumi CLI in the tests.

Why: the program makes its API keys with pulumi-random (pulumi_random.RandomPassword), so
the engine loads the `random` resource plugin. Its Go module
(github.com/pulumi/pulumi-random/provider/v4) is not served by the module proxy (403 at every
version), and it could not be built from the module anyway: its go.mod replaces
terraform-provider-random/shim with a local folder, which a dependency's build ignores. So
the tests put this on PATH instead, only in the tests and `make up` (never in .engine/path): the engine,
the language runtime, the Kubernetes provider and the policy pack stay the real ones.

It speaks the provider protocol of the pinned SDK (pulumi/runtime/proto/provider.proto) for
RandomPassword and RandomString, with the inputs pulumi_random 4.21.4 documents
(random_password.py): length, lower, upper, numeric/number, special, overrideSpecial and the
min* counts; every input forces a replacement, as upstream. In a preview `result` is unknown,
as upstream.
"""

from __future__ import annotations

import secrets
import string

from google.protobuf.json_format import MessageToDict
from pulumi.runtime.proto import provider_pb2
from standin_provider import UNKNOWN, StandInProvider, serve, struct

TYPES = ("random:index/randomPassword:RandomPassword", "random:index/randomString:RandomString")
SPECIAL = "!@#$%&*()-_=+[]{}<>:?"  # pulumi_random: "These are `!@#$%&*()-_=+[]{}<>:?`"


def generate(inputs: dict) -> str:
    length = int(inputs["length"])
    classes = []
    for flag, alphabet, minimum in (("lower", string.ascii_lowercase, "minLower"),
                                    ("upper", string.ascii_uppercase, "minUpper"),
                                    ("numeric", string.digits, "minNumeric"),
                                    ("special", inputs.get("overrideSpecial") or SPECIAL, "minSpecial")):
        enabled = inputs.get(flag, inputs.get("number", True) if flag == "numeric" else True)
        if enabled:
            classes.append((alphabet, int(inputs.get(minimum, 0))))
    chars = [secrets.choice(alphabet) for alphabet, minimum in classes for _ in range(minimum)]
    pool = "".join(alphabet for alphabet, _ in classes)
    chars += [secrets.choice(pool) for _ in range(length - len(chars))]
    secrets.SystemRandom().shuffle(chars)
    return "".join(chars)


class RandomProvider(StandInProvider):
    name = "random"
    types = TYPES

    def Check(self, request, context):
        self.refuse_unknown(request.type, context)
        news = MessageToDict(request.news)
        failures = []
        if int(news.get("length", 0)) < 1:
            failures.append(provider_pb2.CheckFailure(property="length", reason="length must be at least 1"))
        return provider_pb2.CheckResponse(inputs=request.news, failures=failures)

    def Diff(self, request, context):
        olds, news = MessageToDict(request.old_inputs), MessageToDict(request.news)
        changed = sorted(k for k in set(olds) | set(news) if olds.get(k) != news.get(k))
        return provider_pb2.DiffResponse(
            changes=provider_pb2.DiffResponse.DIFF_SOME if changed else provider_pb2.DiffResponse.DIFF_NONE,
            replaces=changed, diffs=changed, deleteBeforeReplace=False)

    def Create(self, request, context):
        inputs = MessageToDict(request.properties)
        result = UNKNOWN if request.preview else generate(inputs)
        return provider_pb2.CreateResponse(id="" if request.preview else "none", properties=struct({**inputs, "result": result}))


if __name__ == "__main__":
    serve(RandomProvider())
