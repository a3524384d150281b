module pdstack.local/contracts

go 1.26

require (
	github.com/llm-d/llm-d-inference-scheduler v0.7.1 // indirect
	sigs.k8s.io/gateway-api-inference-extension v1.4.0 // indirect
)
