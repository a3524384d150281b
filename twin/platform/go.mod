// Chart-carrying Go modules the platform stack installs from or checks against that no other
// twin/*/go.mod pins (one place per pin: infra/platform_stack/modules.py finds each module's folder).
// No package of them is built: `go mod download` fetches each zip and go.sum verifies it.
// cert-manager: deploy/charts/cert-manager (values.yaml, values.schema.json) and its CRDs.
// gpu-operator: the module proxy serves no tagged version (its v25.x tags have no /v25 module
// path), so this is the newest commit it serves (2025-09-17); see infra/platform_stack/catalog.py.
module pdstack.dev/twin/platform

go 1.26.0

require (
	github.com/NVIDIA/gpu-operator v0.0.0-20250917190837-d73a0086a6ba
	github.com/cert-manager/cert-manager v1.21.2
)
