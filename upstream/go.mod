// Go modules whose source pdstack reads (never builds) to derive what the components it
// deploys need: scripts/derive_rbac.py reads the endpoint picker (llm-d-inference-scheduler
// v0.7.1, the version the images, the contract check in contracts/ and the spec pin), the
// framework its main runs (gateway-api-inference-extension v1.4.0, what llm-d v0.7.1's go.mod
// requires), and the controller-runtime and client-go that module requires, at the versions
// go.sum fixes.
module pdstack.dev/upstream

go 1.25.0

require (
	github.com/llm-d/llm-d-inference-scheduler v0.7.1
	k8s.io/client-go v0.35.3
	sigs.k8s.io/controller-runtime v0.23.3
	sigs.k8s.io/gateway-api-inference-extension v1.4.0
)
