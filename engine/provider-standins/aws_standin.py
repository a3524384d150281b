"""A test stand-in for pulumi-aws's provider plugin, for the real Pulumi CLI on the cluster twin.

Why: the serving program makes one EKS Pod Identity association per namespace
(infra/components/platform_links.py), so a prod rollout loads the `aws` resource plugin. Its
Go module is not served by the module proxy (`go list -m -versions
github.com/pulumi/pulumi-aws/provider/v7`: 403 Forbidden, and /v6 too), and its go.mod replaces
terraform-provider-aws with a local folder, which a build as a dependency ignores. So the twin's
tests put this on PATH instead; the engine, the Kubernetes provider and the twin stay real.

It implements the one type the serving program makes, aws:eks/podIdentityAssociation, with
pulumi-aws's inputs (clusterName, namespace, serviceAccount, roleArn, tags) and replacement rules
(a new cluster, namespace or service account replaces the association; a role or tags update it
in place). What EKS would do with it is what matters to a rollout: the Pod Identity webhook gives
credentials to a pod when the pod is admitted, so a pod made before its namespace's association
runs without them. At each create this stand-in asks the cluster (the KUBECONFIG the CLI runs
with) how many pods of that service account the namespace already holds, and records it, with
every create and delete, as a JSON line in $PDSTACK_AWS_STANDIN_RECORD, for the test to judge.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid

from google.protobuf import empty_pb2
from google.protobuf.json_format import MessageToDict
from pulumi.runtime.proto import provider_pb2
from standin_provider import UNKNOWN, StandInProvider, serve, struct

TYPE = "aws:eks/podIdentityAssociation:PodIdentityAssociation"
REPLACED_BY = ("clusterName", "namespace", "serviceAccount")  # ForceNew in the upstream resource
REQUIRED = ("clusterName", "namespace", "serviceAccount", "roleArn")


def record(event: dict) -> None:
    path = os.environ.get("PDSTACK_AWS_STANDIN_RECORD")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(event) + "\n")


def pods_already_there(namespace: str, service_account: str) -> int | None:
    """Pods of `service_account` in `namespace` now (None: no cluster to ask)."""
    try:
        got = subprocess.run(["kubectl", "get", "pods", "-n", namespace, "-o", "json"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if got.returncode != 0:
        return None
    return sum(1 for pod in json.loads(got.stdout)["items"]
               if pod["spec"].get("serviceAccountName") == service_account)


class AwsProvider(StandInProvider):
    name = "aws"
    types = (TYPE,)

    def Check(self, request, context):
        self.refuse_unknown(request.type, context)
        news = MessageToDict(request.news)
        failures = [provider_pb2.CheckFailure(property=key, reason=f"{key} is required")
                    for key in REQUIRED if news.get(key) in (None, "")]
        return provider_pb2.CheckResponse(inputs=request.news, failures=failures)

    def Diff(self, request, context):
        olds, news = MessageToDict(request.old_inputs), MessageToDict(request.news)
        changed = sorted(k for k in set(olds) | set(news) if olds.get(k) != news.get(k) and not k.startswith("__"))
        return provider_pb2.DiffResponse(
            changes=provider_pb2.DiffResponse.DIFF_SOME if changed else provider_pb2.DiffResponse.DIFF_NONE,
            replaces=[k for k in changed if k in REPLACED_BY], diffs=changed, deleteBeforeReplace=True)

    def _outputs(self, inputs: dict, association_id: str) -> dict:
        arn = f"arn:aws:eks:us-east-1:000000000000:podidentityassociation/{inputs.get('clusterName')}/{association_id}"
        return {**inputs, "associationId": association_id, "associationArn": arn, "tagsAll": inputs.get("tags", {})}

    def Create(self, request, context):
        inputs = MessageToDict(request.properties)
        if request.preview:
            return provider_pb2.CreateResponse(id="", properties=struct({**inputs, "associationId": UNKNOWN,
                                                                         "associationArn": UNKNOWN}))
        association_id = "a-" + uuid.uuid4().hex[:17]
        record({"event": "create", "id": association_id, "namespace": inputs["namespace"],
                "serviceAccount": inputs["serviceAccount"], "roleArn": inputs["roleArn"],
                "podsAlreadyThere": pods_already_there(inputs["namespace"], inputs["serviceAccount"])})
        return provider_pb2.CreateResponse(id=association_id, properties=struct(self._outputs(inputs, association_id)))

    def Update(self, request, context):
        inputs = MessageToDict(request.news)
        record({"event": "update", "id": request.id, "namespace": inputs.get("namespace")})
        return provider_pb2.UpdateResponse(properties=struct(self._outputs(inputs, request.id)))

    def Delete(self, request, context):
        record({"event": "delete", "id": request.id, "namespace": MessageToDict(request.properties).get("namespace")})
        return empty_pb2.Empty()


if __name__ == "__main__":
    serve(AwsProvider())
