"""Entry point that Pulumi.yaml names: build the selected stack from its spec."""

from infra.program import main

main()
