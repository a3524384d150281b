// Chart-carrying Go modules the platform stack installs from or checks against that no other
// twin/*/go.mod pins (one place per pin: infra/platform_stack/modules.py finds each module's folder).
// No package of them is built: `go mod download` fetches each zip and go.sum verifies it.
// cert-manager: deploy/charts/cert-manager (values.yaml, values.schema.json) and its CRDs.
// gpu-operator: the module proxy serves no tagged version (its v25.x tags have no /v25 module
// path), so this is the newest commit it serves (2025-09-17); see infra/platform_stack/catalog.py.
// aws-load-balancer-controller: helm/aws-load-balancer-controller (values.yaml, crds/) and
// docs/install/iam_policy.json. The proxy serves none of its v2/v3 tags (no /v3 module path), so
// this is the newest commit it serves (2026-04-23), whose version.txt and chart say 3.2.2.
module pdstack.dev/twin/platform

go 1.26.0

require (
	github.com/NVIDIA/gpu-operator v0.0.0-20250917190837-d73a0086a6ba
	github.com/cert-manager/cert-manager v1.21.2
	sigs.k8s.io/aws-load-balancer-controller v0.0.0-20260423195125-93ff3b5fdaad
)
