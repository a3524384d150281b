"""pdstack: Pulumi toolkit for prefill/decode-disaggregated LLM inference on Kubernetes."""
