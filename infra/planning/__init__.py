"""Pure planning algorithms: expert placement (EPLB) and the prefill/decode ratio."""
