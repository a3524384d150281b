"""Where a stack runs: its environment (name, namespace, cluster, release store), the platform
stack under it, and every image it runs."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator

from infra.images import ImageRef
from infra.inputs import Strict
from infra.naming import OCI_TAGGED_REFERENCE, PULUMI_STACK_REFERENCE, release_store_url_problem
from infra.spec._base import (
    _REGION, NAMESPACE_MAX, _checked, _cidr_list, _dns_label, _service_url, _url_without_credentials)
from infra.weights import SAFE_NAME


class ReleaseStoreSpec(Strict):
    """Where this environment's release history, state and lease live (infra/rollout/releases.py):
    the one place every actor (operators, CI's `pulumi up`, the Pulumi program) finds them."""

    url: str = Field(
        "releases", description="`s3://bucket/prefix` (AWS S3, MinIO, Ceph RGW: what teams use; credentials from the "
                                "standard AWS chain, never from here), or a folder of the project (one operator).")
    endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint, e.g. https://minio.internal:9000; default AWS's (or "
                          "AWS_ENDPOINT_URL_S3 in the environment).")
    region: str = "us-east-1"

    _no_credentials = field_validator("url")(classmethod(lambda cls, v: _url_without_credentials(v)))
    _url = field_validator("endpoint_url")(classmethod(lambda cls, v: _service_url(v)))
    _region = field_validator("region")(_checked(_REGION.fullmatch, "is not a region name. Fix: e.g. us-east-1"))

    @field_validator("url")
    @classmethod
    def _store_url(cls, v: str) -> str:
        problem = release_store_url_problem(v)
        if problem:
            raise ValueError(f"{v[:80]!r}: {problem}")
        return v


class EnvironmentSpec(Strict):
    name: str
    namespace: str
    kubernetes_version: Annotated[str, Field(pattern=r"^1\.\d+$")] = Field(
        "1.33", description="Kubernetes minor version of the cluster, e.g. '1.34' (manifests are checked "
                            "against its schemas).")
    api_server_cidrs: list[str] = Field(
        [], description="Addresses of the Kubernetes API server's endpoints (`kubectl get endpoints kubernetes`), "
                        "which the router or endpoint picker reach for service discovery. Empty: the "
                        "NetworkPolicy lets them reach ports 443 and 6443 anywhere.")
    release_store: ReleaseStoreSpec = ReleaseStoreSpec()

    _api_cidrs = field_validator("api_server_cidrs")(classmethod(lambda cls, v: _cidr_list(v, "10.0.0.12/32")))

    _dns = field_validator("name")(classmethod(lambda cls, v: _dns_label(v)))
    _namespace = field_validator("namespace")(classmethod(lambda cls, v: _dns_label(v, NAMESPACE_MAX)))


class PlatformRef(Strict):
    """The per-cluster platform stack this environment runs on (infra/platform_stack/)."""

    stack: str = Field(description="Its Pulumi stack, as a StackReference names it: <org>/pdstack/<stack>, or the "
                                   "stack's name alone in the same organization and project (a two-part name is "
                                   "<org>/<stack>).")
    spec: str = Field(description="Its platform spec, relative to the project (what the offline preview and the "
                                  "cross-checks read).")
    # Pulumi's names: organization, project and stack of letters, digits, '-', '_', '.', 100 at most each.
    _stack = field_validator("stack")(_checked(
        lambda v: PULUMI_STACK_REFERENCE.fullmatch(v),
        "is not a stack reference (<org>/<project>/<stack>, each 100 characters at most). Fix: e.g. "
        "example/pdstack/platform-prod"))
    # Pulumi reads a two-part name as <org>/<stack>: "pdstack/platform-dev" names an organization
    # called pdstack, which no self-managed backend has ("organization name must be 'organization'").
    _not_project_slash_stack = field_validator("stack")(_checked(
        lambda v: not re.fullmatch(r"pdstack/[^/]+", v),
        "names organization 'pdstack' (Pulumi reads <a>/<b> as <org>/<stack>). Fix: the stack's name alone "
        "(e.g. platform-prod) or <org>/pdstack/<stack>"))
    _spec = field_validator("spec")(_checked(lambda v: re.fullmatch(SAFE_NAME, v) and v.endswith((".yaml", ".yml"))
                                             and len(v) <= 255,
                                             "is not a project file path of a YAML spec. Fix: e.g. "
                                             "stacks/platform-prod.yaml"))

    def name(self) -> str:
        return self.stack.rsplit("/", 1)[-1]


class EngineImageSpec(Strict):
    """One engine's image and what it was built with. A fabric is only as usable as the libraries in
    the image: EFA is reached through AWS's libfabric alone, and the stock SGLang and vLLM images
    carry neither it nor aws-ofi-nccl (images/engine-efa.Dockerfile builds one that does)."""

    image: ImageRef = Field(description="Pinned by digest (name@sha256:...), or a marked placeholder ({ref: name:tag, "
                                        "digest: placeholder}); its platforms are listed in images.platforms.")
    efa_libfabric: bool = Field(False, description="AWS's libfabric with the EFA provider (the EFA installer).")
    aws_ofi_nccl: bool = Field(False, description="NCCL's libfabric plugin (aws-ofi-nccl): NCCL between nodes over EFA.")
    mooncake_efa: bool = Field(
        False, description="Mooncake's transfer engine built with EFA support (its `efa` transport); Mooncake "
                           "publishes it for x86_64 only.")
    nixl_backends: list[Literal["UCX", "LIBFABRIC"]] = Field(
        ["UCX"], description="NIXL's backend plugins in the image (stock builds: UCX; LIBFABRIC is built against "
                             "the EFA installer's libfabric).")


class ImagesSpec(Strict):
    """Every image, each pinned by digest or marked a placeholder (infra/images.py)."""

    engines: dict[Literal["sglang", "vllm"], EngineImageSpec] = Field(
        min_length=1, description="Each engine's image and what it contains; engine.kind picks one, so "
                                  "`render --engine` runs the other engine in its own image.")
    router: ImageRef
    mooncake_master: ImageRef
    lmcache_server: ImageRef
    weights_fetcher: ImageRef = Field(description="Image for the weights init step; what it must hold is "
                                             "weights_fetcher_tool.")
    weights_fetcher_tool: Literal["aws-cli", "python-boto3"] = Field(
        "aws-cli", description="aws-cli: the image has `aws` and `sha256sum` (amazon/aws-cli does); "
                               "python-boto3: it has python3 with boto3.")
    otel_collector: ImageRef
    endpoint_picker: ImageRef | None = Field(
        None, description="llm-d-inference-scheduler's endpoint picker (gateway_epp), e.g. "
                          "ghcr.io/llm-d/llm-d-inference-scheduler@sha256:... of v0.7.1.")
    routing_sidecar: ImageRef | None = Field(
        None, description="llm-d's routing sidecar for decode pods (gateway_epp, disaggregated), e.g. "
                          "ghcr.io/llm-d/llm-d-routing-sidecar@sha256:... of v0.7.1.")

    loadtest: ImageRef | None = Field(
        None, description="NVIDIA aiperf at the release pdstack pins (infra/validation/loadtest.py), for the "
                          "in-cluster load-test Job `pdctl validate-deployment --render-job` writes.")
    platforms: dict[str, list[Literal["amd64", "arm64"]]] = Field(
        default_factory=dict,
        description="The CPU architectures each image digest runs on, keyed by digest (sha256:...), or by a "
                    "placeholder's reference (name:tag) for the platforms it is to be built for: one for a "
                    "single-platform manifest, the index's platforms for a manifest list, as `pdctl images` "
                    "reads them from the registry. A digest names one manifest, so it has the same "
                    "platforms in every stack. Every image that runs on the GPU nodes (the engine's, the "
                    "weights fetcher, the routing sidecar) must be listed with hardware.cpu_architecture; "
                    "images with one platform pin their CPU pods to it.")

    @field_validator("platforms")
    @classmethod
    def _digest_keys(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        for digest, archs in v.items():
            if not (re.fullmatch(r"sha256:[0-9a-f]{64}", digest) or OCI_TAGGED_REFERENCE.fullmatch(digest)):
                raise ValueError(f"{digest[:80]!r} is not an image digest or a placeholder's reference. Fix: the "
                                 "sha256:<64 hex digits> after '@' in the image reference, or a placeholder's name:tag")
            if not archs:
                raise ValueError(f"{digest}: no platforms. Fix: the architectures its manifest names, e.g. [amd64]")
        return v
