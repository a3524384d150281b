// Go modules whose source pdstack reads (never builds) to derive what the components it
// deploys need: scripts/derive_rbac.py reads the endpoint picker's framework and the
// controller-runtime and client-go it is built with, at the versions go.sum fixes.
// gateway-api-inference-extension v1.5.0 is what llm-d-inference-scheduler v0.8.0's go.mod
// requires (infra/render/pinned/llm-d-inference-scheduler-0.8.0.json, "inference_extension");
// controller-runtime and client-go are that module's own requirements.
module pdstack.dev/upstream

go 1.25.0

require (
	k8s.io/client-go v0.35.3
	sigs.k8s.io/controller-runtime v0.23.3
	sigs.k8s.io/gateway-api-inference-extension v1.5.0
)
